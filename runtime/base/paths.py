"""Where spillpack keeps things on a machine."""

import os
from pathlib import Path


def spillpack_home() -> Path:
    """SPILLPACK_HOME, or ~/.spillpack: models, caches, and the state of jobs run without --state."""
    home = os.environ.get("SPILLPACK_HOME")
    return Path(home).expanduser() if home else Path.home() / ".spillpack"
