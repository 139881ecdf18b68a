"""`spillpack`: the runtime's job commands plus what only a laptop needs (pack, models, status --plot)."""

from runtime.cli import exit_process
from runtime.cli import main as runtime_main

LAPTOP_COMMANDS = {
    "models": ("spillpack.commands.models", "the model tags spillpack knows and the models on this machine", "spillpack models"),
    "pack": ("spillpack.pack.command", "pack a job into one directory that runs anywhere with ./run.sh",
             "spillpack pack tune.json -o out/packed --scheduler slurm"),
    "status": ("spillpack.commands.status", "the story of a job from its state: processes, checkpoints, interruptions",
               "spillpack status mine"),
}


def main(argv: list[str] | None = None) -> None:
    exit_process(runtime_main(argv, extra=LAPTOP_COMMANDS))
