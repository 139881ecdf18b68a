"""The one error type of spillpack, and the exit codes of docs/events.md.

Anything that should reach a user as a clean line raises SpillpackError (exit 1)
or UsageError (exit 2); the CLI catches them in one place and prints
`spillpack: <what went wrong>. Try: <command>`.
"""

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_PREEMPTED = 75


class SpillpackError(Exception):
    exit_code = EXIT_ERROR

    def __init__(self, what: str, try_: str = "spillpack --help"):
        self.what = what.rstrip(". ")
        self.try_ = try_
        super().__init__(self.line())

    def line(self) -> str:
        return f"spillpack: {self.what}. Try: {self.try_}"


class UsageError(SpillpackError):
    exit_code = EXIT_USAGE
