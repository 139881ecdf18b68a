"""The scheduler examples: rendered from the templates pack uses, and checked by each
scheduler's own validator (SkyPilot's parser, Kubernetes' OpenAPI schemas in strict mode)
plus the rules those let through (tests/support/scheduler_checks.py). The Slurm script is run on
a real cluster in tests/test_slurm.py."""

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from spillpack.schedulers.examples import BUILD_EXAMPLE, EXAMPLE, EXAMPLE_SHARDED, EXAMPLES
from spillpack.schedulers.files import KINDS, render, values_for
from tests.conftest import REPO
from tests.support.scheduler_checks import kubernetes_problems, skypilot_problems

K8S_VERSIONS = ("1.31.0", "1.32.0", "1.33.0", "1.34.0", "1.35.0")  # what the examples claim (podFailurePolicy GA in 1.31)


@pytest.mark.parametrize("kind", KINDS)
def test_examples_are_the_templates_rendered(kind):
    examples = (EXAMPLE, EXAMPLE_SHARDED, BUILD_EXAMPLE) if kind == "skypilot" else (EXAMPLE, EXAMPLE_SHARDED)
    for values in examples:  # the group's: test_scheduler_groups.py
        for fname, text in render(kind, values).items():
            assert (EXAMPLES / kind / fname).read_text() == text, f"{fname}: run python -m spillpack.schedulers"
            assert (EXAMPLES / kind / "README.md").exists()


# -- SkyPilot -----------------------------------------------------------------------------

def sky_python() -> str | None:
    """skypilot cannot live beside transformers (click pins), so it has its own venv."""
    for cand in (os.environ.get("SPILLPACK_SKY_PYTHON"), str(REPO / ".venv-sky/bin/python")):
        if cand and Path(cand).exists():
            return cand
    return None


def sky_parse(path: Path, *env: str) -> dict:
    """`env`: K=V given at launch, as `sky jobs launch --env K=V` does."""
    py = sky_python()
    if py is None:
        pytest.skip("skypilot is not installed: make setup builds .venv-sky (or SPILLPACK_SKY_PYTHON=python-with-skypilot)")
    args = [a for kv in env for a in ("--env", kv)]
    r = subprocess.run([py, str(REPO / "tests/support/sky_parse.py"), str(path), *args], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise AssertionError(f"sky.Task.from_yaml refused {path.name}:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.splitlines()[-1])


@pytest.fixture
def sky_dir(tmp_path):
    (tmp_path / EXAMPLE.bundle).mkdir()  # the workdir must exist where one launches
    return tmp_path


def test_skypilot_sharded_example_is_one_managed_job_per_shard(tmp_path):
    """The fan-out chosen for SkyPilot: N managed jobs, each recovering on its own, each told its
    shard by --env SPILLPACK_SHARD=I at launch; a launch that forgets it is refused by SkyPilot."""
    (tmp_path / EXAMPLE_SHARDED.bundle).mkdir()
    src = EXAMPLES / "skypilot" / f"{EXAMPLE_SHARDED.bundle}.sky.yaml"
    shutil.copy(src, tmp_path / src.name)
    with pytest.raises(AssertionError, match="SPILLPACK_SHARD"):
        sky_parse(tmp_path / src.name)
    parsed = sky_parse(tmp_path / src.name, "SPILLPACK_SHARD=3")
    assert parsed["envs"]["SPILLPACK_SHARD"] == "3"
    raw = yaml.safe_load(src.read_text())
    assert skypilot_problems(raw, parsed, EXAMPLE_SHARDED.bundle) == []
    text = src.read_text()
    assert "for i in $(seq 0 3)" in text and "--env SPILLPACK_SHARD=$i" in text and "-n spillpack-rows-$i" in text


@pytest.mark.parametrize("example", [BUILD_EXAMPLE, EXAMPLE], ids=["build", "tune"])
def test_skypilot_example_parses_and_keeps_the_contract(sky_dir, example):
    (sky_dir / example.bundle).mkdir(exist_ok=True)
    src = EXAMPLES / "skypilot" / f"{example.bundle}.sky.yaml"
    shutil.copy(src, sky_dir / src.name)
    parsed = sky_parse(sky_dir / src.name)
    assert parsed["sky_version"] == "0.14.1"
    raw = yaml.safe_load(src.read_text())
    assert skypilot_problems(raw, parsed, example.bundle) == []
    assert example.job in src.read_text().splitlines()[0]


@pytest.mark.parametrize("mutate,problem", [
    (lambda d: d["resources"]["job_recovery"].update(recover_on_exit_code=[75]), "unknown keys in job_recovery"),
    (lambda d: d["resources"]["job_recovery"].update(strategy="EAGER_NEXT_ZONE"), "is not one of"),
    (lambda d: d["resources"]["job_recovery"].update(recover_on_exit_codes=[1]), "exit code 75"),
])
def test_skypilot_checks_catch_what_the_parser_lets_through(sky_dir, mutate, problem):
    doc = yaml.safe_load((EXAMPLES / "skypilot" / f"{EXAMPLE.bundle}.sky.yaml").read_text())
    mutate(doc)
    path = sky_dir / "broken.sky.yaml"
    path.write_text(yaml.safe_dump(doc))
    parsed = sky_parse(path)  # sky's parser accepts it ...
    assert any(problem in p for p in skypilot_problems(doc, parsed, EXAMPLE.bundle))  # ... ours does not


def test_skypilot_parser_refuses_a_bad_exit_code(sky_dir):
    doc = yaml.safe_load((EXAMPLES / "skypilot" / f"{EXAMPLE.bundle}.sky.yaml").read_text())
    doc["resources"]["job_recovery"]["recover_on_exit_codes"] = [300]
    path = sky_dir / "bad.sky.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(AssertionError, match="refused"):
        sky_parse(path)


# -- Kubernetes ---------------------------------------------------------------------------


def _k8s_job(python: str, with_torch: bool) -> dict:
    config = {"command": "tune", "options": {"name": "mine", "state": "s3://b/state/mine"}}
    values = values_for(config, Path("/x/mine"), python, with_torch)
    text = render("kubernetes", values)["mine.k8s-cuda.yaml"]
    return yaml.safe_load(text), text


@pytest.mark.parametrize("python,with_torch", [("3.11", False), ("3.12", False), ("3.10", True)])
def test_kubernetes_runs_the_bundles_own_image(python, with_torch):
    """The bundle is in its image (its Containerfile, FROM spillpack:VARIANT): no command, no bundle on the volume."""
    doc, text = _k8s_job(python, with_torch)
    spec = doc["spec"]["template"]["spec"]
    container = spec["containers"][0]
    assert container["image"] == "spillpack-mine:cuda" and "command" not in container
    assert "podman build -t spillpack-mine:cuda --build-arg FLAVOR=cuda mine" in text
    assert "pytorch/pytorch" not in text and "/work" not in text
    assert [m["mountPath"] for m in container["volumeMounts"]] == ["/data"]
    assert kubernetes_problems(doc) == []
    # The pod's grace period is the job's budget.
    grace = spec["terminationGracePeriodSeconds"]
    assert {"name": "SPILLPACK_GRACE_S", "value": str(grace)} in container["env"]
    kv = pytest.importorskip("kubernetes_validate")
    kv.validate(doc, K8S_VERSIONS[0], strict=True)

def k8s_docs():
    for path in sorted((EXAMPLES / "kubernetes").glob(f"{EXAMPLE.bundle}.k8s-*.yaml")):  # the group's: test_scheduler_groups.py
        for doc in yaml.safe_load_all(path.read_text()):
            yield path.name, doc


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_kubernetes_examples_validate_strictly(version):
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed (pip install '.[test]')")
    names = []
    for name, doc in k8s_docs():
        kv.validate(doc, version, strict=True)  # raises on any unknown field or wrong type
        names.append(name)
    assert len(names) == 3


def test_kubernetes_examples_keep_the_contract():
    seen = {}
    for name, doc in k8s_docs():
        assert kubernetes_problems(doc) == [], name
        seen[name] = doc
    cuda = seen[f"{EXAMPLE.bundle}.k8s-cuda.yaml"]["spec"]["template"]["spec"]["containers"][0]
    cpu = seen[f"{EXAMPLE.bundle}.k8s-cpu.yaml"]["spec"]["template"]["spec"]["containers"][0]
    assert cuda["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "nvidia.com/gpu" not in cpu["resources"]["limits"]
    assert {"name": "SPILLPACK_ENGINE", "value": "torch-cpu"} in cpu["env"]


def sharded_docs():
    for path in sorted((EXAMPLES / "kubernetes").glob(f"{EXAMPLE_SHARDED.bundle}.k8s-*.yaml")):
        yield path.name, yaml.safe_load(path.read_text())


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_kubernetes_sharded_examples_validate_strictly_and_keep_the_contract(version):
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed (pip install '.[test]')")
    seen = {}
    for name, doc in sharded_docs():
        kv.validate(doc, version, strict=True)
        assert kubernetes_problems(doc) == [], name
        seen[name] = doc
    assert len(seen) == 3
    for variant in ("cuda", "cpu"):
        spec = seen[f"{EXAMPLE_SHARDED.bundle}.k8s-{variant}.yaml"]["spec"]
        assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == EXAMPLE_SHARDED.shards
    assert seen[f"{EXAMPLE_SHARDED.bundle}.k8s-pvc.yaml"]["spec"]["accessModes"] == ["ReadWriteMany"]


@pytest.mark.parametrize("mutate,problem", [
    (lambda s: s.update(parallelism=1), "parallelism 1 is not completions 4"),
    (lambda s: s.pop("backoffLimitPerIndex"), "no backoffLimitPerIndex"),
    (lambda s: s["podFailurePolicy"]["rules"][2].update(action="FailJob"), "use FailIndex"),
    (lambda s: s["template"]["spec"]["containers"][0]["env"].append({"name": "JOB_COMPLETION_INDEX", "value": "0"}),
     "sets its own shard index"),
    (lambda s: s.pop("completionMode"), "needs completionMode Indexed"),
])
def test_kubernetes_checks_catch_what_the_schema_lets_through_in_a_sharded_job(mutate, problem):
    kv = pytest.importorskip("kubernetes_validate")
    doc = copy.deepcopy(yaml.safe_load((EXAMPLES / "kubernetes" / f"{EXAMPLE_SHARDED.bundle}.k8s-cuda.yaml").read_text()))
    mutate(doc["spec"])
    kv.validate(doc, K8S_VERSIONS[0], strict=True)
    assert any(problem in p for p in kubernetes_problems(doc))


def _job():
    return copy.deepcopy(yaml.safe_load((EXAMPLES / "kubernetes" / f"{EXAMPLE.bundle}.k8s-cuda.yaml").read_text()))


def _rules(d):
    return d["spec"]["podFailurePolicy"]["rules"]


@pytest.mark.parametrize("mutate,problem", [
    (lambda d: d["spec"]["template"]["spec"].update(restartPolicy="OnFailure"), "requires restartPolicy Never"),
    (lambda d: _rules(d)[0].update(action="Ignored"), "action 'Ignored'"),
    (lambda d: _rules(d)[0]["onExitCodes"].update(operator="Equals"), "operator 'Equals'"),
    (lambda d: _rules(d)[0]["onExitCodes"].update(values=[76]), "exit 75 is not"),
    (lambda d: _rules(d).pop(1), "DisruptionTarget"),
    (lambda d: d["spec"]["template"]["spec"].update(terminationGracePeriodSeconds=30), "terminationGracePeriodSeconds"),
])
def test_kubernetes_checks_catch_what_the_schema_lets_through(mutate, problem):
    kv = pytest.importorskip("kubernetes_validate")
    doc = _job()
    mutate(doc)
    kv.validate(doc, K8S_VERSIONS[0], strict=True)  # the schema accepts it ...
    assert any(problem in p for p in kubernetes_problems(doc))  # ... ours does not


def test_kubernetes_schema_refuses_an_unknown_field():
    kv = pytest.importorskip("kubernetes_validate")
    doc = _job()
    doc["spec"]["template"]["spec"]["terminationGracePeriod"] = 60
    with pytest.raises(kv.ValidationError):
        kv.validate(doc, K8S_VERSIONS[0], strict=True)


# -- spillpack pack --scheduler -----------------------------------------------------------

@pytest.mark.slow
def test_pack_writes_each_schedulers_file_beside_the_bundle(home, tmp_path):
    from tests.conftest import run_cli

    data = tmp_path / "train.jsonl"
    data.write_text("\n".join((REPO / "examples/data/train.jsonl").read_text().splitlines()[:8]) + "\n")
    out = tmp_path / "out"
    r = run_cli(["pack", "tune", "tiny", str(data), "--steps", "2", "--name", "My_Job.v2", "--state", "s3://bkt/state/my-job",
                 "-o", str(out / "job1"), "--scheduler", "skypilot", "--scheduler", "slurm", "--scheduler", "kubernetes"])
    assert r.returncode == 0, r.stderr[-3000:]
    names = sorted(p.name for p in out.iterdir())
    assert names == ["job1", "job1.k8s-cpu.yaml", "job1.k8s-cuda.yaml", "job1.k8s-pvc.yaml", "job1.sbatch", "job1.sky.yaml"]
    assert all(f"wrote {out / n}" in r.stderr for n in names if n != "job1")

    sky = yaml.safe_load((out / "job1.sky.yaml").read_text())
    assert sky["name"] == "spillpack-my-job-v2" and sky["workdir"] == "./job1"
    assert "s3://bkt/state/my-job" in (out / "job1.sky.yaml").read_text()
    assert skypilot_problems(sky, sky_parse(out / "job1.sky.yaml"), "job1") == []

    kv = pytest.importorskip("kubernetes_validate")
    for n in ("job1.k8s-cpu.yaml", "job1.k8s-cuda.yaml", "job1.k8s-pvc.yaml"):
        doc = yaml.safe_load((out / n).read_text())
        kv.validate(doc, K8S_VERSIONS[0], strict=True)
        assert kubernetes_problems(doc) == []
    job = yaml.safe_load((out / "job1.k8s-cuda.yaml").read_text())
    assert job["spec"]["template"]["spec"]["containers"][0]["image"] == "spillpack-my-job-v2:cuda"

    sbatch = (out / "job1.sbatch").read_text()
    assert "#SBATCH --job-name=spillpack-my-job-v2" in sbatch and "packed=job1\nbundle=${SPILLPACK_BUNDLE:-$SLURM_SUBMIT_DIR/$packed}" in sbatch
    assert subprocess.run(["bash", "-n", str(out / "job1.sbatch")]).returncode == 0

    # Never overwritten: a second pack naming the same files is refused before anything is written.
    (out / "job1.sbatch").write_text("mine")
    shutil.rmtree(out / "job1")
    again = run_cli(["pack", "tune", "tiny", str(data), "--steps", "2", "-o", str(out / "job1"), "--scheduler", "slurm"])
    assert again.returncode == 2 and "job1.sbatch already exists" in again.stderr
    assert (out / "job1.sbatch").read_text() == "mine" and not (out / "job1").exists()
