"""Run by the Python that has `skypilot` (it cannot share an environment with
transformers: skypilot 0.14.1 pins click<8.2, huggingface-hub needs click>=8.4.2).

    python tests/sky_parse.py FILE.yaml  ->  JSON on stdout: what sky.Task.from_yaml made of it
"""

import json
import os
import sys

import sky
from sky.jobs import recovery_strategy  # noqa: F401  registers the strategies
from sky.utils import registry


def main(path: str) -> None:
    os.chdir(os.path.dirname(os.path.abspath(path)))  # workdir is relative to where one launches
    task = sky.Task.from_yaml(path)
    res = [{"accelerators": r.accelerators, "cpus": r.cpus, "memory": r.memory, "use_spot": r.use_spot,
            "job_recovery": r.job_recovery} for r in task.resources]
    print(json.dumps({
        "sky_version": sky.__version__,
        "name": task.name,
        "num_nodes": task.num_nodes,
        "workdir": task.workdir,
        "setup": task.setup,
        "run": task.run,
        "envs": task.envs,
        "secrets": sorted(task.secrets),
        "secret_refs": sorted(r.name for r in task.managed_secret_refs),
        "resources": res,
        "strategies": sorted(registry.JOBS_RECOVERY_STRATEGY_REGISTRY.keys()),
    }, default=str))


if __name__ == "__main__":
    main(sys.argv[1])
