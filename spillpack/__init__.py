"""spillpack, the laptop side: the CLI, config emit, `pack`, scheduler files."""

from runtime import __version__  # one version for the packer and the runtime it packs

__all__ = ["__version__"]
