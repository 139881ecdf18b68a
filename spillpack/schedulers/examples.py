"""The example jobs whose scheduler files live in the repository's examples/schedulers/,
and their writer (`python -m spillpack.schedulers`): rendered by the same templates as a
packed job's files, kept equal to them by a test."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from spillpack.schedulers.files import JOBS, KINDS, Values, write

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "schedulers"

EXAMPLE = Values(name="mine", bundle="mine", state="s3://my-bucket/spillpack/state/mine",
                 weights="s3://my-bucket/spillpack/weights/qwen2.5-0.5b")
# The same job as a data-parallel tune on 2 nodes of 8 GPUs (`pack --nodes 2 --gpus-per-node 8`).
EXAMPLE_GROUP = replace(EXAMPLE, name="mine-dp", bundle="mine-dp", state="s3://my-bucket/spillpack/state/mine-dp",
                        nodes=2, gpus_per_node=8)
# A batch `run` split into 4 shards (`pack run ... --shards 4`).
EXAMPLE_SHARDED = replace(EXAMPLE, name="rows", bundle="rows", state="s3://my-bucket/spillpack/state/rows", shards=4)
EXAMPLES_ALL = (EXAMPLE, EXAMPLE_GROUP, EXAMPLE_SHARDED)
# SkyPilot's first example is a folder build, as spill's was; the tune above is its second.
BUILD_EXAMPLE = Values(name="task", bundle="task", state="s3://my-bucket/spillpack/state/task", job=JOBS["build"])


def write_examples(root: Path = EXAMPLES) -> list[Path]:
    out = []
    for kind in KINDS:
        (root / kind).mkdir(parents=True, exist_ok=True)
        for example in EXAMPLES_ALL:
            out += write(kind, example, root / kind)
    out += write("skypilot", BUILD_EXAMPLE, root / "skypilot")
    return out


