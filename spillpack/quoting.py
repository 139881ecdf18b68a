"""Every value written into a generated file (run.sh, the sbatch script, SkyPilot and
Kubernetes YAML) goes through one of these functions; nothing is pasted as it is.

sh       a shell word: shlex.quote
yaml     a YAML scalar or list: JSON (a subset of YAML), so no value can end its line or add a key
comment  text for a `#` comment: kept when it is plain printable ASCII, else JSON-escaped, so no
         newline (nor a YAML line break: CR, NEL, U+2028) can end the comment
word     a value that must stay one token where quoting is not understood (an #SBATCH value,
         a version inside a YAML block of shell): refused unless [A-Za-z0-9._:+-]

Each returns `Quoted`, and the scheduler templates refuse any output that is not Quoted.
"""

from __future__ import annotations

import json
import re
import shlex


class Quoted(str):
    """Text that went through a quoting function."""


_PLAIN = re.compile(r"[\x20-\x7e]*")
_WORD = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:+-]*")


def sh(value) -> Quoted:
    return Quoted(shlex.quote(str(value)))


def yaml(value) -> Quoted:
    return Quoted(json.dumps(value, ensure_ascii=True))


def comment(value) -> Quoted:
    text = str(value)
    return Quoted(text if _PLAIN.fullmatch(text) else json.dumps(text, ensure_ascii=True))


def word(value) -> Quoted:
    text = str(value)
    if not _WORD.fullmatch(text):
        raise ValueError(f"{text!r} cannot be written unquoted into a generated file")
    return Quoted(text)
