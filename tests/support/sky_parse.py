"""Run by the Python that has `skypilot` (it cannot share an environment with
transformers: skypilot 0.14.1 pins click<8.2, huggingface-hub needs click>=8.4.2).

    python tests/support/sky_parse.py FILE.yaml [--env K=V]...  ->  JSON on stdout: what sky.Task.from_yaml made of it
                                                        (with --env: what `sky jobs launch --env K=V` gives it)
"""

import json
import os
import sys

import sky
import yaml
from sky.jobs import recovery_strategy  # noqa: F401  registers the strategies
from sky.utils import registry


def main(path: str, envs: list[tuple[str, str]]) -> None:
    os.chdir(os.path.dirname(os.path.abspath(path)))  # workdir is relative to where one launches
    if envs:
        with open(path) as f:
            task = sky.Task.from_yaml_config(yaml.safe_load(f), env_overrides=envs)
    else:
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
    main(sys.argv[1], [tuple(v.split("=", 1)) for k, v in zip(sys.argv[2::2], sys.argv[3::2]) if k == "--env"])
