"""Which engines a bundle can use on each target, and the framework wheels it may carry
for an offline first start: torch (--with-torch cpu|cuda) and, for Apple silicon, mlx
(--with-mlx). Without them the target's own Python must have the framework.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from runtime.bootstrap.platforms import is_apple_silicon, parse_tag
from runtime.base.errors import UsageError

from . import wheels

TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name).split("+")[0]
    except importlib.metadata.PackageNotFoundError:
        return None


def check(platforms: list[str], with_torch: str | None, with_mlx: bool) -> None:
    """Refuse a combination that cannot work before anything is downloaded."""
    if with_torch == "cuda":
        not_linux = [t for t in platforms if parse_tag(t)[0] != "linux"]
        if not_linux:
            raise UsageError(f"--with-torch cuda needs Linux targets, not {not_linux[0]}", "--with-torch cpu")
    if with_torch and _installed("torch") is None:
        raise UsageError("--with-torch bundles the torch installed here, and there is none", "pip install torch")
    if with_mlx and not any(is_apple_silicon(t) for t in platforms):
        raise UsageError(f"--with-mlx carries mlx for Apple silicon, and no target is ({', '.join(platforms)})",
                         "spillpack pack ... --platform macosx_14_0_arm64 --with-mlx")


def torch_wheels(flavor: str, tag: str, python: str) -> list[Path]:
    """torch at this machine's version, with everything it needs, for the target (pip resolves the closure)."""
    os_ = tag.split("_")[0]
    extra = ("--index-url", TORCH_CPU_INDEX, "--extra-index-url", "https://pypi.org/simple") if flavor == "cpu" and os_ == "manylinux" else ()
    return wheels.fetch(tag, python, [f"torch=={_installed('torch')}"], extra_pip=extra, with_deps=True)


def mlx_wheels(tag: str, python: str) -> list[Path]:
    """mlx and its Metal library for an Apple silicon target. pip evaluates mlx's
    `platform_system == "Darwin"` marker on this machine, so mlx-metal is asked for by name,
    at mlx's version: the one installed here, else the newest with a wheel for the target."""
    version = _installed("mlx")
    if version is None:
        version = wheels.dist_of(wheels.fetch(tag, python, ["mlx"])[0]).split()[1]
    return wheels.fetch(tag, python, [f"mlx=={version}", f"mlx-metal=={version}"])


def carried(platforms: list[str], python: str, with_torch: str | None, with_mlx: bool) -> dict[str, list[Path]]:
    """TAG -> the framework wheels to put under wheels/TAG/."""
    out = {}
    for tag in platforms:
        ws = torch_wheels(with_torch, tag, python) if with_torch else []
        if with_mlx and is_apple_silicon(tag):
            ws += mlx_wheels(tag, python)
        if ws:
            out[tag] = ws
    return out


def usable(tag: str, with_torch: str | None, with_mlx: bool) -> list[str]:
    """The engines a bundle can use on `tag`; '(bundled)' when it carries the framework,
    '(target's torch)' when the target's Python must have it."""
    os_ = parse_tag(tag)[0]
    out = []
    if is_apple_silicon(tag):
        out.append("mlx (bundled)" if with_mlx else "mlx (target's mlx)")
    if with_torch == "cuda":
        out += ["torch-cuda (bundled)", "torch-cpu (bundled)"]
    elif with_torch == "cpu":
        out.append("torch-cpu (bundled)")
    else:
        out += (["torch-cuda (target's torch)"] if os_ == "linux" else []) + ["torch-cpu (target's torch)"]
    return out
