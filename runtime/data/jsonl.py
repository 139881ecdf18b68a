"""JSONL files behind a URI, read for every job: the whole file streamed in with each line
bounded (a weights file or a dump given as data stops at its first long line, not at its
end), bundled files checked against the manifest, and the objects line by line."""

import stat

import orjson

from runtime.base.errors import SpillpackError
from runtime.state.store import local_file
from runtime.state.uri import open_store

# One JSONL line is one conversation or request: a longer line is not data of ours.
MAX_LINE_BYTES = 16 << 20
# How deep a record's objects and lists may nest. A conversation or a JSON schema nests a few
# levels (a deep schema some tens); orjson, which writes what is read back out, stops at 254.
MAX_NESTING = 100
CHUNK_BYTES = 1 << 20  # data is read in pieces this size (at most MAX_LINE_BYTES: bounded_lines relies on it)


def read_bytes(uri: str, what: str = "data", bundle=None, missing_ok: bool = False) -> bytes | None:
    """The whole file behind a path, file:// or s3:// URI, read as it streams in and refused as
    soon as a line passes MAX_LINE_BYTES (a weights file or a dump given as data stops there,
    not at its end); a bundled file is checked against the bundle's manifest. `missing_ok`:
    None for a file that does not exist (any other failure is still an error: a damaged file
    is never taken for an absent one)."""
    path = local_file(uri)
    if path is None:
        parent, _, name = uri.rstrip("/").rpartition("/")
        data = open_store(parent).read_stream(name, lambda chunks: bounded_lines(chunks, uri, f"aws s3 cp {uri} - | head -c 300"))
        if data is None and not missing_ok:
            raise SpillpackError(f"{what} {uri} does not exist", f"aws s3 ls {parent}/")
        return data
    try:
        # A FIFO would block forever and /dev/zero never ends: only a regular file is data.
        if path.exists() and not path.is_dir() and not stat.S_ISREG(path.stat().st_mode):
            raise SpillpackError(f"{what} {uri} is not a regular file (a pipe, device or socket cannot be read as data)",
                                 f"copy it to a file first: cat {uri} > data.jsonl")
        with path.open("rb") as f:
            data = bounded_lines(iter(lambda: f.read(CHUNK_BYTES), b""), uri, f"head -c 300 {uri}")
    except FileNotFoundError:
        if missing_ok:
            return None
        raise SpillpackError(f"{what} file {uri} does not exist", f"ls {path.parent}")
    except IsADirectoryError:
        raise SpillpackError(f"{what} {uri} is a directory, not a JSONL file", f"ls {path}")
    except OSError as e:
        raise SpillpackError(f"cannot read {what} {uri}: {e.strerror}", f"ls -l {path}")
    if bundle is not None:
        bundle.check_read(path, data)  # a bundled file must be the one that was packed
    return data


def bounded_lines(chunks, uri: str, try_: str) -> bytes:
    """The bytes of `chunks` joined, or one line naming the first line longer than MAX_LINE_BYTES,
    raised once that much of it has arrived. Only a line that spans pieces can be too long (a
    piece is at most CHUNK_BYTES), so each piece costs a find, a count and an rfind."""
    buf = bytearray()
    line_start, line_no = 0, 1  # where the line being read begins in buf, and its number
    for chunk in chunks:
        for i in range(0, len(chunk), CHUNK_BYTES):
            piece = chunk[i:i + CHUNK_BYTES] if len(chunk) > CHUNK_BYTES else chunk
            at = len(buf)
            buf += piece
            first = piece.find(b"\n")
            if (len(buf) if first < 0 else at + first) - line_start > MAX_LINE_BYTES:
                raise SpillpackError(f"{uri} line {line_no} is longer than the {MAX_LINE_BYTES >> 20} MiB a line may hold "
                                     "(is it JSONL?)", try_)
            if first >= 0:
                line_no += piece.count(b"\n")
                line_start = at + piece.rfind(b"\n") + 1
    return bytes(buf)


def iter_jsonl(raw: bytes, uri: str, nonfinite: bool = False):
    """(line number, object) for each non-blank line; a bad line is one error naming it. `raw`
    comes from read_bytes, which bounds its lines. `nonfinite`: NaN and Infinity, which Python's
    json.dumps writes, are read as floats, so the row that carries one is refused by its own checks."""
    if not raw.strip():
        raise SpillpackError(f"{uri} is empty", f"head {uri}")
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError as e:
            obj = _with_nonfinite(line) if nonfinite else None
            if obj is None:
                raise SpillpackError(f"{uri} line {n} is not JSON ({str(e).split(':')[0]})", f"sed -n {n}p {uri}")
        if not isinstance(obj, dict):
            raise SpillpackError(f"{uri} line {n} is not a JSON object", f"sed -n {n}p {uri}")
        yield n, obj


def _with_nonfinite(line: bytes):
    """The line as Python's json reads it, only where orjson's one objection is NaN or Infinity
    (not lone surrogates, which Python's json would let through)."""
    import json

    if b"NaN" not in line and b"Infinity" not in line:
        return None
    try:
        obj = json.loads(line)
        orjson.dumps(obj)  # refuses what orjson refuses besides the constants
    except (ValueError, RecursionError, TypeError, orjson.JSONEncodeError):
        return None
    return obj


def nesting_past(obj, limit: int = MAX_NESTING) -> bool:
    """Whether `obj`'s objects and lists nest deeper than `limit` (counted without recursion, so
    a record built to exhaust the stack is only a record that is too deep)."""
    stack = [(obj, 1)]
    while stack:
        x, depth = stack.pop()
        if depth > limit:
            return True
        if isinstance(x, dict):
            stack.extend((v, depth + 1) for v in x.values() if isinstance(v, (dict, list)))
        elif isinstance(x, list):
            stack.extend((v, depth + 1) for v in x if isinstance(v, (dict, list)))
    return False
