"""`spillpack`: the runtime's job commands plus what only a laptop needs (pack, models)."""

import sys

from runtime.cli import main as runtime_main

LAPTOP_COMMANDS = {
    "models": ("spillpack.commands.models", "the model tags spillpack knows and the models on this machine"),
    "pack": ("spillpack.pack.command", "pack a job into one directory that runs anywhere with ./run.sh"),
}


def main(argv: list[str] | None = None) -> None:
    sys.exit(runtime_main(argv, extra=LAPTOP_COMMANDS))
