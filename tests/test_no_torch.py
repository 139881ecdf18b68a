"""A machine with mlx and no torch runs every job on --engine mlx, from the CLI and from a bundle.

torch is made unimportable in the job's process the way a machine without it behaves: a
sitecustomize.py on PYTHONPATH puts None in sys.modules["torch"], so `import torch` (and any
`import torch.x`) raises ModuleNotFoundError and importlib.util.find_spec("torch") is None,
which is what hardware probing and the bundle's bootstrap look at.
"""

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.numpy import load_file

from tests.conftest import REPO, events_of, run_cli

pytest.importorskip("mlx.core")

BLOCKER = 'import sys\nsys.modules["torch"] = None  # what `import torch` finds on a machine without it\n'
EVALS = REPO / "examples/data/evals.jsonl"
TRAIN = REPO / "examples/data/train.jsonl"
PROMPTS = REPO / "examples/data/prompts.jsonl"


@pytest.fixture
def no_torch(tmp_path) -> Path:
    d = tmp_path / "no-torch"
    d.mkdir()
    (d / "sitecustomize.py").write_text(BLOCKER)
    return d


def first_lines(src: Path, dst: Path, n: int) -> Path:
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text("".join(src.read_text().splitlines(True)[:n]))
    return dst


def cli(args, blocker: Path, **kw):
    return run_cli([*args, "--engine", "mlx"], env={"PYTHONPATH": f"{blocker}{os.pathsep}{REPO}"}, **kw)


def ok(r) -> list[dict]:
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    return events_of(r.stdout)


def assert_adapter(adapter: Path, targets: set[str], layers: int):
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    assert {k.split(".")[-3] for k in tensors} == targets
    assert len(tensors) == 2 * len(targets) * layers
    # B starts at zero: a non-zero B means the optimizer really stepped.
    assert all(abs(v).max() > 0 for k, v in tensors.items() if ".lora_B." in k)
    assert json.loads((adapter / "adapter_config.json").read_text())["target_modules"] == sorted(targets)
    assert (adapter / "mlx" / "adapters.safetensors").is_file()


def custom_ids(path: Path) -> list[str]:
    return [json.loads(line)["custom_id"] for line in path.read_text().splitlines()]


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_only_the_torch_engine_imports_torch():
    """The framework-neutral parts import neither framework; the MLX engine never imports torch
    nor the torch engine's code (and the reverse)."""
    runtime = REPO / "runtime"
    offenders = {}
    for path in sorted(runtime.rglob("*.py")):
        rel = path.relative_to(runtime).as_posix()
        mods = imported_modules(path)
        if rel.startswith("engines/torch/"):
            bad = {m for m in mods if m.split(".")[0] == "mlx" or m.startswith("runtime.engines.mlx")}
        elif rel.startswith("engines/mlx/"):
            bad = {m for m in mods if m.split(".")[0] == "torch" or m.startswith("runtime.engines.torch")}
        elif rel == "engines/hardware.py":
            continue  # it probes and measures every installed framework, each import guarded by find_spec
        else:
            bad = {m for m in mods if m.split(".")[0] in ("torch", "mlx")}
        if bad:
            offenders[rel] = sorted(bad)
    assert offenders == {}


def test_torch_is_really_blocked(no_torch):
    code = ("import importlib.util, sys\n"
            "assert importlib.util.find_spec('torch') is None\n"
            "try:\n    import torch.nn\nexcept ImportError:\n    sys.exit(3)\n")
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(no_torch)})
    assert r.returncode == 3


def test_every_job_runs_on_mlx_without_torch(home, no_torch, tmp_path):
    train = first_lines(TRAIN, tmp_path / "d" / "train.jsonl", 24)
    rows = first_lines(EVALS, tmp_path / "d" / "rows.jsonl", 6)
    expected_ids = custom_ids(rows)

    ev = ok(cli(["tune", "tiny", str(train), "--steps", "3", "--batch", "2", "--lr", "1e-3",
                 "--targets", "q_proj,v_proj", "--state", str(tmp_path / "tune")], no_torch))
    assert {e["engine"] for e in ev} == {"mlx"}
    assert [e["step"] for e in ev if e["event"] == "step"] == [1, 2, 3]
    assert ev[-1]["event"] == "done" and ev[-1]["complete"] and ev[-1]["steps"] == 3
    assert_adapter(tmp_path / "tune" / "adapter", {"q_proj", "v_proj"}, layers=4)

    out = tmp_path / "run.jsonl"
    ev = ok(cli(["run", "tiny", str(rows), "--max-tokens", "4", "--adapter", str(tmp_path / "tune" / "adapter"),
                 "--state", str(tmp_path / "run"), "--out", str(out)], no_torch))
    assert ev[-1]["complete"] and ev[-1]["rows"] == 6 and ev[-1]["failed_rows"] == 0
    assert custom_ids(out) == expected_ids  # every row once, in input order
    assert all(json.loads(x)["response"]["status_code"] == 200 for x in out.read_text().splitlines())

    ev = ok(cli(["eval", "tiny", str(rows), "--max-tokens", "4", "--state", str(tmp_path / "eval")], no_torch))
    assert ev[-1]["rows"] == 6 and 0.0 <= ev[-1]["accuracy"] <= 1.0
    assert custom_ids(tmp_path / "eval" / "results.jsonl") == expected_ids

    prompts = first_lines(PROMPTS, tmp_path / "d" / "prompts.jsonl", 4)
    distilled = tmp_path / "distilled.jsonl"
    ev = ok(cli(["distill", "tiny", str(prompts), "--max-tokens", "4", "--state", str(tmp_path / "distill"),
                 "--out", str(distilled)], no_torch))
    done = ev[-1]
    # The untuned tiny may answer a prompt with its end-of-turn token alone: such empty answers
    # are left out of the training data, and counted.
    assert done["complete"] and done["failed_rows"] == 0 and done["examples"] + done["empty_answers"] == 4
    lines = [json.loads(x) for x in distilled.read_text().splitlines()]
    assert len(lines) == done["examples"] and all(x["messages"][-1]["role"] == "assistant" for x in lines)
    assert len(custom_ids(tmp_path / "distill" / "answers.jsonl")) == 4


@pytest.mark.slow
def test_build_runs_on_mlx_without_torch(home, no_torch, tmp_path):
    folder = tmp_path / "f"
    first_lines(EVALS, folder / "evals.jsonl", 4)
    first_lines(TRAIN, folder / "train.jsonl", 12)
    first_lines(PROMPTS, folder / "prompts.jsonl", 3)
    ev = ok(cli(["build", str(folder), "--steps", "2", "--max-tokens", "4", "--batch", "2", "--teacher", "tiny",
                 "--state", str(tmp_path / "b")], no_torch, timeout=600))
    assert ev[-1]["complete"] and set(ev[-1]["stages"]) == {"distill", "tune", "eval"}
    assert {e["engine"] for e in ev if "engine" in e} == {"mlx"}


# -- from a bundle --------------------------------------------------------------------------


@pytest.fixture
def pack_home(home, tmp_path_factory):
    # The packer's wheel and zipapp caches, shared with test_pack's session cache when it ran first.
    cache = tmp_path_factory.getbasetemp() / "no-torch-pack-cache"
    (home / "cache").mkdir(exist_ok=True)
    for sub in ("wheels", "pyz"):
        (cache / sub).mkdir(parents=True, exist_ok=True)
        (home / "cache" / sub).symlink_to(cache / sub)
    return home


def run_bundle(bundle: Path, home: Path, blocker: Path):
    """run.sh as a node runs it: a clean environment whose python3 has mlx, and no torch."""
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(home.parent),
           "SPILLPACK_HOME": str(home), "TMPDIR": str(home.parent / "tmp"), "PYTHONPATH": str(blocker),
           "SPILLPACK_METADATA_URL": os.environ["SPILLPACK_METADATA_URL"]}
    (home.parent / "tmp").mkdir(parents=True, exist_ok=True)
    return subprocess.run([str(bundle / "run.sh")], capture_output=True, text=True, env=env, cwd="/", timeout=600)


def node_home(tmp_path: Path, home: Path, name: str) -> Path:
    h = tmp_path / name / "home"
    shutil.copytree(home / "models", h / "models")
    return h


@pytest.mark.slow
def test_bundles_run_on_mlx_without_torch(pack_home, no_torch, tmp_path):
    train = first_lines(TRAIN, tmp_path / "src" / "train.jsonl", 24)
    rows = first_lines(EVALS, tmp_path / "src" / "rows.jsonl", 6)

    cfg = tmp_path / "tune.json"
    ok(run_cli(["tune", "tiny", str(train), "--steps", "3", "--batch", "2", "--max-seq", "96", "--name", "nt",
                "--targets", "q_proj,o_proj", "--engine", "mlx", "--emit-config", str(cfg)]))
    r = run_cli(["pack", str(cfg), "-o", str(tmp_path / "tune-bundle")], timeout=600)
    assert r.returncode == 0, r.stderr
    node = node_home(tmp_path, pack_home, "node1")
    ev = ok(run_bundle(tmp_path / "tune-bundle", node, no_torch))
    assert {e["engine"] for e in ev} == {"mlx"}
    assert ev[-1]["event"] == "done" and ev[-1]["complete"] and ev[-1]["steps"] == 3
    assert_adapter(node / "jobs" / "nt" / "adapter", {"q_proj", "o_proj"}, layers=4)

    cfg = tmp_path / "run.json"
    ok(run_cli(["run", "tiny", str(rows), "--max-tokens", "4", "--name", "ntrun", "--engine", "mlx",
                "--emit-config", str(cfg)]))
    r = run_cli(["pack", str(cfg), "-o", str(tmp_path / "run-bundle")], timeout=600)
    assert r.returncode == 0, r.stderr
    node = node_home(tmp_path, pack_home, "node2")
    ev = ok(run_bundle(tmp_path / "run-bundle", node, no_torch))
    assert {e["engine"] for e in ev} == {"mlx"}
    assert ev[-1]["complete"] and ev[-1]["rows"] == 6 and sum(e["event"] == "row" for e in ev) == 6
    assert custom_ids(node / "jobs" / "ntrun" / "results.jsonl") == custom_ids(rows)
