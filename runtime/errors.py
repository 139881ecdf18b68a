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
