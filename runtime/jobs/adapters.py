"""`--adapter` of the row jobs (run, eval, distill): one plain `--adapter SRC`, or many named
ones, `--adapter NAME=SRC` (repeatable), that rows choose between by their `body.model`.

SRC is a PEFT adapter directory, an mlx-lm adapter directory, a LoRA adapter GGUF (llama.cpp's
`--lora` file) or a spillpack tune state, a path
or s3://, read and checked against the base by --init-adapter's own loader (init_adapter.py):
every tensor a LoRA pair of a linear this base has, in its shape, and the base the adapter
records, where it records one.

With named adapters a row's `body.model` picks its model: the job's model (as the command
names it, or its directory's name) or no `model` is the base, an adapter's NAME is that
adapter, anything else is that row's error line. Without named adapters `body.model` is not
read, as OpenAI's batch files name one model for every row; rows that name more than one
model there ask for adapters the job does not have, which is refused before anything runs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from runtime.base.errors import SpillpackError
from runtime.base.fileio import sha256_bytes
from runtime.bootstrap.manifest import BUNDLE_PREFIX
from runtime.jobs import init_adapter
from runtime.models.lora import PEFT_CONFIG, PEFT_WEIGHTS, LoraSpec
from runtime.state.uri import open_store

NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}\Z")
# The repeated option arrives joined with commas (options.Opt.repeat): a comma starts a new
# adapter only where NAME= follows, so a plain path with a comma in it stays one SRC.
_SPLIT = re.compile(r",(?=[^,/:=]*=)")
BASE = -1


@dataclass
class Adapter:
    name: str | None  # None: the one plain --adapter SRC
    src: str
    tensors: dict
    spec: LoraSpec
    fingerprint: str  # part of the job's identity and of each row's system_fingerprint


def parse(value: str | None) -> list[tuple[str | None, str]]:
    """(NAME or None, SRC) for each adapter the option names."""
    if not value:
        return []
    out = []
    for part in _SPLIT.split(value):
        name, sep, src = part.partition("=")
        if sep and "/" not in name and ":" not in name:
            if not NAME.match(name):
                raise SpillpackError(f"--adapter {part}: {name!r} is not an adapter name (a letter or _, then letters, digits, "
                                     "_, . or -, at most 64)", f"--adapter {_safe(name)}={src}")
            if not src:
                raise SpillpackError(f"--adapter {part} names no adapter after =", f"--adapter {name}=DIR")
            out.append((name, src))
        else:
            out.append((None, part))
    if len(out) > 1 and any(n is None for n, _ in out):
        plain = next(s for n, s in out if n is None)
        raise SpillpackError(f"--adapter {plain} has no name, beside named adapters: rows could not choose it",
                             f"--adapter NAME={plain}")
    seen = {}
    for name, src in out:
        if name in seen:
            raise SpillpackError(f"--adapter {name}= is given twice ({seen[name]} and {src}): rows naming it could not tell them apart",
                                 "another NAME for one of them")
        seen[name] = src
    return out


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name).lstrip("0123456789.-") or "a"


def load(value: str | None, model_dir, base_names: set[str], bundle=None) -> list[Adapter]:
    """Each adapter the option names, read and checked against the base in `model_dir`; in a
    bundle, a named adapter's bundled SRC is localized and checked as a plain option's value is."""
    out = []
    for name, src in parse(value):
        if bundle is not None and src.startswith(BUNDLE_PREFIX):
            src = bundle.localize({"adapter": src})["adapter"]
        if name in base_names:
            raise SpillpackError(f"--adapter {name}={src}: {name!r} is the base model's name, which rows use for the base",
                                 f"another NAME, e.g. --adapter {name}-tuned={src}")
        try:
            got = init_adapter.load(src, model_dir, {})
        except SpillpackError as e:  # the loader's lines name its own option
            raise SpillpackError(e.what.replace("--init-adapter", "--adapter", 1), e.try_) from None
        fingerprint = got.sha256
        if name is None and got.kind == "peft":
            # A plain --adapter's fingerprint is its two files' hash, as it has always been: its states resume.
            store = open_store(src)
            fingerprint = sha256_bytes(b"".join(store.read(f) for f in (PEFT_CONFIG, PEFT_WEIGHTS)))
        out.append(Adapter(name, src, got.tensors, got.spec, fingerprint))
    return out


def identity(adapters: list[Adapter]) -> dict:
    """The job identity's part: a plain adapter's fingerprint as before, named ones by name."""
    if adapters and adapters[0].name is not None:
        return {"adapter": None, "adapters": sorted([a.name, a.fingerprint] for a in adapters)}
    return {"adapter": adapters[0].fingerprint if adapters else None}


def route(rows: list, adapters: list[Adapter], base: str, base_names: set[str], every_model: bool) -> list:
    """Each row's adapter (`adapter`: an index into the named adapters, or BASE) and the model it
    is answered as (`served`). `every_model` (eval): every row once for the base and once per
    named adapter, as `custom_id@NAME` rows (`custom_id@base` for the base). Returns the rows to run."""
    named = [a.name for a in adapters if a.name is not None]
    if not named:
        asked = sorted({r.model for r in rows if r.model is not None and r.model not in base_names})
        if len(asked) > 1:
            raise SpillpackError(f"rows name {len(asked)} models ({', '.join(map(repr, asked[:4]))}) and this job has no named "
                                 f"adapter to answer them", f"--adapter {_safe(asked[0])}=DIR for each, or one model in every row")
        for r in rows:
            r.adapter, r.served = BASE, base
        return rows
    if every_model:
        out = []
        for r in rows:
            for index, name in [(BASE, "base"), *enumerate(named)]:
                out.append(replace(r, index=len(out), custom_id=f"{r.custom_id}@{name}", adapter=index,
                                   served=base if index == BASE else name))
        return out
    for r in rows:
        if r.model is None or r.model in base_names:
            r.adapter, r.served = BASE, base
        elif r.model in named:
            r.adapter, r.served = named.index(r.model), r.model
        else:
            r.adapter, r.served = BASE, base
            if r.error is None:
                r.error, r.error_param = (f"model {r.model!r}"[:80] + f" is not served by this job (it serves {base} and the "
                                          f"adapters {', '.join(named)})"), "model"
    return rows


def for_engine(adapters: list[Adapter], rows: list):
    """What the engine loads for `rows`: a plain adapter's (tensors, spec), or for named ones the
    one that every row uses, none for base rows only, else the list (one batch of many adapters);
    and whether each request names its adapter (the list)."""
    if not adapters:
        return None, False
    if adapters[0].name is None:
        return (adapters[0].tensors, adapters[0].spec), False
    used = {r.adapter for r in rows}
    if used == {BASE}:
        return None, False
    if len(used) == 1:
        a = adapters[used.pop()]
        return (a.tensors, a.spec), False
    return [(a.tensors, a.spec) for a in adapters], True
