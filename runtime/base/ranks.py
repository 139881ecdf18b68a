"""Which rank of a data-parallel group this process is, from the environment torchrun (or any
env:// launcher) gives each process. Standard library only: the CLI asks before any engine
is imported, so ranks other than 0 stay quiet from their first event."""

import os


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def world_size() -> int:
    return max(1, _env_int("WORLD_SIZE", 1))


def local_world_size() -> int:
    """The ranks on this machine (torchrun's LOCAL_WORLD_SIZE)."""
    return max(1, _env_int("LOCAL_WORLD_SIZE", 1)) if world_size() > 1 else 1


def rank() -> int:
    return _env_int("RANK", 0) if world_size() > 1 else 0


def quiet() -> bool:
    """Ranks other than 0 emit no events and write no status file (rank 0 speaks for the group)."""
    return rank() != 0
