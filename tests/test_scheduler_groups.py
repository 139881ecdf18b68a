"""Scheduler files for a data-parallel tune (`pack --nodes N --gpus-per-node G`): the examples
are the templates rendered, each passes its scheduler's own validator and our checks, and
what makes the group meet (node count, ranks, rendezvous address) is in each. The Slurm one
runs on a real cluster in tests/test_slurm_group.py."""

import shutil
import subprocess

import pytest
import yaml

from conftest import REPO, run_cli
from tests.support.scheduler_checks import kubernetes_problems, skypilot_problems
from spillpack.schedulers.examples import EXAMPLE_GROUP as G
from spillpack.schedulers.examples import EXAMPLES
from spillpack.schedulers.files import KINDS, render
from test_scheduler_files import K8S_VERSIONS, sky_parse


@pytest.mark.parametrize("kind", KINDS)
def test_group_examples_are_the_templates_rendered(kind):
    for fname, text in render(kind, G).items():
        assert (EXAMPLES / kind / fname).read_text() == text, f"{fname}: run python -m spillpack.schedulers"


def k8s_docs():
    for path in sorted((EXAMPLES / "kubernetes").glob(f"{G.bundle}.k8s-*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            yield path.name, doc


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_kubernetes_group_validates_strictly(version):
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed (pip install '.[test]')")
    kinds = []
    for name, doc in k8s_docs():
        kv.validate(doc, version, strict=True)
        kinds.append(doc["kind"])
    assert sorted(kinds) == ["Job", "Job", "PersistentVolumeClaim", "Service", "Service"]


@pytest.mark.parametrize("variant", ["cuda", "cpu"])
def test_kubernetes_group_is_an_indexed_job_that_meets_at_pod_0(variant):
    docs = [d for n, d in k8s_docs() if n == f"{G.bundle}.k8s-{variant}.yaml"]
    svc, job = (next(d for d in docs if d["kind"] == k) for k in ("Service", "Job"))
    assert kubernetes_problems(job) == []
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == G.nodes
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"] == {"batch.kubernetes.io/job-name": job["metadata"]["name"]}
    assert pod["subdomain"] == svc["metadata"]["name"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    # Indexed pods are named <job>-<index> under the subdomain; the node rank is JOB_COMPLETION_INDEX
    assert env["SPILLPACK_MASTER_ADDR"] == f"{job['metadata']['name']}-0.{svc['metadata']['name']}"
    assert env["SPILLPACK_NNODES"] == str(G.nodes) and env["SPILLPACK_NPROC"] == str(G.gpus_per_node)
    assert "SPILLPACK_NODE_RANK" not in env
    limits = pod["containers"][0]["resources"]["limits"]
    assert limits.get("nvidia.com/gpu") == (G.gpus_per_node if variant == "cuda" else None)
    pvc = yaml.safe_load((EXAMPLES / "kubernetes" / f"{G.bundle}.k8s-pvc.yaml").read_text())
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]  # pods on different nodes read the one bundle


def test_skypilot_group_parses_and_keeps_the_contract(tmp_path):
    (tmp_path / G.bundle).mkdir()
    src = EXAMPLES / "skypilot" / f"{G.bundle}.sky.yaml"
    shutil.copy(src, tmp_path / src.name)
    parsed = sky_parse(tmp_path / src.name)
    raw = yaml.safe_load(src.read_text())
    assert skypilot_problems(raw, parsed, G.bundle) == []
    assert parsed["num_nodes"] == G.nodes and parsed["envs"]["SPILLPACK_NPROC"] == str(G.gpus_per_node)
    assert {a for r in parsed["resources"] for a in (r["accelerators"] or {}).values()} == {G.gpus_per_node}


def test_slurm_group_script_starts_one_task_per_node():
    path = EXAMPLES / "slurm" / f"{G.bundle}.sbatch"
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    text = path.read_text()
    for line in (f"#SBATCH --nodes={G.nodes}", "#SBATCH --ntasks-per-node=1", f"#SBATCH --gres=gpu:{G.gpus_per_node}",
                 f"export SPILLPACK_NPROC=${{SPILLPACK_NPROC:-{G.gpus_per_node}}}"):
        assert line in text.splitlines(), line
    assert f'srun --nodes={G.nodes} --ntasks-per-node=1 --kill-on-bad-exit=0 "$bundle/run.sh" "$@" &' in text


@pytest.mark.parametrize("extra,what", [
    (["--nodes", "2"], "none was asked for"),
    (["--scheduler", "slurm", "--nodes", "2", "--engine", "mlx"], "mlx engine runs one process"),
    (["--scheduler", "slurm", "--gpus-per-node", "0"], "--gpus-per-node must be positive"),
])
def test_pack_refuses_a_group_it_cannot_run(home, tmp_path, extra, what):
    data = tmp_path / "train.jsonl"
    data.write_text((REPO / "examples/data/train.jsonl").read_text().splitlines()[0] + "\n")
    r = run_cli(["pack", "tune", "tiny", str(data), "--steps", "2", "-o", str(tmp_path / "out"), *extra])
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and what in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_pack_refuses_a_group_for_a_row_job(home, tmp_path):
    rows = tmp_path / "in.jsonl"
    rows.write_text('{"custom_id": "a", "prompt": "hi"}\n')
    r = run_cli(["pack", "run", "tiny", str(rows), "-o", str(tmp_path / "out"), "--scheduler", "slurm", "--gpus-per-node", "2"])
    assert r.returncode == 1 and "only tune is data-parallel" in r.stderr and r.stderr.count("\n") == 1, r.stderr
