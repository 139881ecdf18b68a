"""The one error type of spillpack, and the exit codes of docs/events.md.

Anything that should reach a user as a clean line raises SpillpackError (exit 1)
or UsageError (exit 2); the CLI catches them in one place and prints
`spillpack: <what went wrong>. Try: <command>`.

Every error line passes through `redact`, so credentials a URL carries (an
AWS_ENDPOINT_URL of http://user:secret@host) never reach stderr, an error event or the
status file. Standard library only: the bundle's bootstrap uses this module.
"""

import re

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_PREEMPTED = 75

# scheme://userinfo@ : greedy up to the last '@' before the path, so a password holding '@' goes too
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s?#]*@")


def env_choice(variable: str, choices: tuple[str, ...]) -> str | None:
    """The value of an environment variable that picks one of `choices` (None where unset or
    empty); any other value is the one refusal."""
    import os

    chosen = os.environ.get(variable, "").strip().lower()
    if chosen and chosen not in choices:
        raise SpillpackError(f"{variable}={os.environ[variable]!r} is not {' or '.join(choices)}",
                             f"{variable}={choices[0]}, or unset it")
    return chosen or None


def redact(text: str) -> str:
    """`text` with the userinfo of every URL in it replaced by ***: the one redaction for shown or stored URLs."""
    return _USERINFO.sub(r"\1***@", text)


class SpillpackError(Exception):
    exit_code = EXIT_ERROR

    def __init__(self, what: str, try_: str = "spillpack --help"):
        self.what = redact(what).rstrip(". ")
        self.try_ = redact(try_)
        super().__init__(self.line())

    def line(self) -> str:
        return f"spillpack: {self.what}. Try: {self.try_}"


class UsageError(SpillpackError):
    exit_code = EXIT_USAGE


def from_os_error(e: OSError) -> SpillpackError:
    """One line for a file operation the machine refused (a full disk, a read-only file system,
    a directory that cannot be created), naming the file and, when it lies under
    SPILLPACK_HOME, that setting."""
    import errno
    import os

    from runtime.base.paths import spillpack_home

    # A copy that fails names both files (shutil: the source first): the one that could not be
    # written is the second.
    full = e.errno in (errno.ENOSPC, errno.EDQUOT)
    where = (e.filename2 if full and getattr(e, "filename2", None) else e.filename) or "a file"
    home = str(spillpack_home().absolute())
    folder = os.path.dirname(str(where)) or "."
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        what, try_ = f"no space left on the disk of {where} ({e.strerror})", \
            f"free space there (df -h {folder}), then the same command again: it continues from its last commit"
    elif e.errno == errno.EROFS:
        what, try_ = f"{where} is on a read-only file system", "a path on a writable disk"
    else:
        # Reads reach here too (a manifest, a blob, a model file): the operation is not known, the file is.
        what, try_ = f"cannot use {where}: {e.strerror}", f"ls -ld {folder}"
    if str(where).startswith(home.rstrip("/") + "/") or str(where) == home:
        what, try_ = f"SPILLPACK_HOME {home} cannot be used: {what}", "export SPILLPACK_HOME=a directory you can write"
    return SpillpackError(what, try_)
