"""--report-to: one tracker run per job across its preemptions, read back by each tracker's own
reader (TensorBoard's EventAccumulator, MlflowClient, W&B's offline run folders).

One job is SIGTERMed twice, SIGKILLed once (past its last checkpoint, so steps are done
again) and then finished, with real processes and real signals; an uninterrupted job with the
same options is the oracle for every curve."""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, events_of, one_line, run_cli
from tests.support.jobproc import run_until

DATA = str(REPO / "examples/data/train.jsonl")
STEPS = 60
BASE = ["tune", "tiny", DATA, "--steps", str(STEPS), "--batch", "4", "--lr", "2e-3", "--warmup", "3",
        "--targets", "q_proj,v_proj", "--rank", "4", "--ckpt-every", "10"]
ALL = ["--report-to", "tensorboard,mlflow", "--report-to", "wandb"]  # comma-separated and repeated
SECRETS = {"WANDB_API_KEY": "wandb-secret-4f1e9a", "MLFLOW_TRACKING_TOKEN": "mlflow-secret-7c2b0d"}
TRACKER_ENV = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true", **SECRETS}


def _at(step):
    return lambda e: e["event"] == "step" and e["step"] == step


def _caught_up(state, past: int):
    """For the SIGKILL: true at a step past `past` once the trackers of this process have the
    steps after its last checkpoint (TensorBoard) and that checkpoint's steps (MLflow), so the
    kill leaves logged steps that the next process does again."""
    seen = {"ckpt": None}

    def when(e):
        if e["event"] == "checkpoint":
            seen["ckpt"] = e["step"]
        c = seen["ckpt"]
        # Early in a checkpoint interval: the signal lands a few steps later than it is sent, still before the next commit.
        if e["event"] != "step" or e["step"] <= past or c is None or not 2 <= e["step"] - c <= 4:
            return False
        newest = max((state / "tensorboard").glob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime)
        metric = list((state / "mlruns").glob("*/*/metrics/train/loss"))
        mlflow_steps = {int(line.split()[2]) for line in metric[0].read_text().splitlines()} if metric else set()
        return max(_file_steps(newest), default=0) > c and c in mlflow_steps
    return when


def _file_steps(path):
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    return [e.step for e in EventFileLoader(str(path)).Load() if e.HasField("summary") and e.summary.value[0].tag == "train/loss"]


# The tests of the shared jobs carry xdist_group("trackers"): one worker runs those jobs once.
@pytest.fixture(scope="module")
def jobs(tiny_home, tmp_path_factory):
    """The reference (uninterrupted) and the interrupted job, each with every tracker."""
    root = tmp_path_factory.mktemp("trackers")
    env = {"SPILLPACK_HOME": str(tiny_home), **TRACKER_ENV}
    ref = run_cli(BASE + ALL + ["--state", str(root / "ref")], env=env)
    assert ref.returncode == 0, ref.stderr
    args = BASE + ALL + ["--state", str(root / "job")]
    runs = []
    for when, sig in ((_at(3), signal.SIGTERM), (_at(9), signal.SIGTERM), (_caught_up(root / "job", 20), signal.SIGKILL)):
        rc, events, err = run_until(args, when, sig=sig, env=env)
        assert rc == (75 if sig == signal.SIGTERM else -signal.SIGKILL), err
        runs.append(events)
    last = run_cli(args, env=env)
    assert last.returncode == 0, last.stderr
    runs.append(events_of(last.stdout))
    return {"ref": root / "ref", "job": root / "job", "runs": runs, "stderr": last.stderr, "ref_events": events_of(ref.stdout)}


def _losses(events):
    return {e["step"]: e["loss"] for e in events if e["event"] == "step"}


@pytest.mark.slow
@pytest.mark.xdist_group("trackers")
def test_the_job_was_cut_where_the_test_says(jobs):
    """Two preemptions, then a hard kill past a checkpoint: steps done twice, which no tracker may show twice."""
    runs = jobs["runs"]
    assert [e["event"] for e in runs[0] + runs[1] if e["event"] == "preempted"] == ["preempted", "preempted"]
    killed_at = max(_losses(runs[2]))
    committed = max(e["step"] for e in runs[2] if e["event"] == "checkpoint")
    assert killed_at > committed  # steps past the last checkpoint, done again by the last process
    assert min(_losses(runs[3])) == committed + 1
    assert not any(e["event"] == "warning" for run in runs for e in run)


def _scalars(logdir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc, [(e.step, e.value) for e in acc.Scalars(tag)]


@pytest.mark.slow
@pytest.mark.xdist_group("trackers")
def test_tensorboard_shows_one_curve_equal_to_the_uninterrupted_one(jobs):
    import numpy as np

    acc, curve = _scalars(jobs["job"] / "tensorboard", "train/loss")
    _, ref = _scalars(jobs["ref"] / "tensorboard", "train/loss")
    assert [s for s, _ in curve] == list(range(1, STEPS + 1))  # each step exactly once
    assert curve == ref
    expected = _losses(jobs["ref_events"])
    assert [v for _, v in curve] == [np.float32(expected[s]).item() for s in range(1, STEPS + 1)]
    assert len(list((jobs["job"] / "tensorboard").glob("events.out.tfevents.*"))) == 4  # one file per process, one log dir
    seams = {tag.split("/")[1] for tag in acc.Tags()["tensors"] if tag.startswith("seams/")}
    assert {"interrupted", "resumed", "hard_kill", "done"} <= seams
    text = acc.Tensors("seams/hard_kill/text_summary")[0].tensor_proto.string_val[0].decode()
    committed = max(e["step"] for e in jobs["runs"][2] if e["event"] == "checkpoint")
    assert "hard kill" in text and f"last commit at step {committed}" in text
    if os.environ.get("SPILLPACK_TRACKERS_PNG"):  # docs/trackers-curve.png is this test's curve, drawn
        _draw(curve, jobs["runs"], os.environ["SPILLPACK_TRACKERS_PNG"])


def _draw(curve, runs, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2), dpi=110)
    ax.plot([s for s, _ in curve], [v for _, v in curve], color="#1f77b4", lw=1.6, label="train/loss (TensorBoard, 4 processes)")
    for n, run in enumerate(runs[:2]):
        step = next(e["step"] for e in run if e["event"] == "preempted")
        ax.axvline(step, color="#d62728", ls="--", lw=1, label="SIGTERM: checkpoint, exit 75" if n == 0 else None)
    committed = max(e["step"] for e in runs[2] if e["event"] == "checkpoint")
    reached = max(_losses(runs[2]))
    ax.axvspan(committed, reached, color="#ff7f0e", alpha=0.25, label=f"SIGKILL: steps {committed + 1}-{reached} done again, shown once")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("one tune, one TensorBoard run, across its preemptions")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def test_no_report_to_imports_no_tracker(home, tmp_path):
    code = ("import sys\nfrom runtime.cli import main\n"
            f"code = main({BASE[:3] + ['--steps', '2', '--state', str(tmp_path / 's')]!r})\n"
            "assert code == 0, code\n"
            "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('tensorboardX', 'tensorboard', 'mlflow', 'wandb', "
            "'runtime') and (m.split('.')[0] != 'runtime' or m.startswith('runtime.trackers.')))\n"
            "print(loaded)\nassert loaded == [], loaded\n")
    env = {**os.environ, "SPILLPACK_HEADLESS": "1"}
    env.pop("SPILLPACK_REPORT_TO", None)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert not (tmp_path / "s" / "trackers").exists()


def test_unknown_tracker_is_a_usage_error(home, tmp_path):
    r = run_cli(BASE[:3] + ["--report-to", "tensorboard,comet", "--state", str(tmp_path / "s")])
    one_line(r, "--report-to 'comet'", "tensorboard, mlflow, wandb", code=2)
    r = run_cli(BASE[:3] + ["--state", str(tmp_path / "s")], env={"SPILLPACK_REPORT_TO": "neptune"})
    one_line(r, "'neptune'", code=2)
    assert not (tmp_path / "s").exists()


def test_missing_library_and_unwritable_dir_fail_before_the_job(home, tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text('import sys\nsys.modules["wandb"] = None\n')
    r = run_cli(BASE[:3] + ["--report-to", "wandb", "--state", str(tmp_path / "s")], env={"PYTHONPATH": f"{site}:{REPO}"})
    one_line(r, "--report-to wandb needs wandb", "pip install 'spillpack[wandb]'")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    r = run_cli(BASE[:3] + ["--report-to", "tensorboard", "--state", str(tmp_path / "s")],
                env={"SPILLPACK_TENSORBOARD_DIR": str(blocker / "tb")})
    one_line(r, "--report-to tensorboard: cannot write its log dir", "SPILLPACK_TENSORBOARD_DIR=")
    assert not (tmp_path / "s").exists()


@pytest.mark.slow
@pytest.mark.xdist_group("trackers")
def test_mlflow_sees_one_run_with_the_uninterrupted_history(jobs):
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    def history(state):
        record = json.loads((state / "trackers" / "mlflow.json").read_text())
        client = MlflowClient(tracking_uri=(state / "mlruns").as_uri())
        runs = client.search_runs([record["experiment_id"]])
        return client, record, runs, [(m.step, m.value) for m in client.get_metric_history(record["run_id"], "train/loss")]

    client, record, runs, curve = history(jobs["job"])
    _, _, _, ref = history(jobs["ref"])
    assert [r.info.run_id for r in runs] == [record["run_id"]]  # one run for the four processes
    assert sorted(s for s, _ in curve) == list(range(1, STEPS + 1))  # each step once, the redone ones too
    assert sorted(curve) == sorted(ref)
    run = client.get_run(record["run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["steps"] == str(STEPS) and run.data.params["command"] == "tune"
    seams = sorted(k.rsplit(".", 1)[1] for k in run.data.tags if k.startswith("spillpack.seam."))
    assert seams.count("interrupted") == 2 and seams.count("resumed") == 3 and seams.count("hard_kill") == 1
    note = run.data.tags["mlflow.note.content"]
    assert "interrupted by SIGTERM" in note and "hard kill" in note and "resumed at step" in note
    assert [(m.step, m.value) for m in client.get_metric_history(record["run_id"], "result/final_loss")] == \
        [(STEPS, jobs["ref_events"][-1]["final_loss"])]


@pytest.mark.slow
@pytest.mark.xdist_group("trackers")
def test_wandb_offline_is_one_run_across_the_processes(jobs):
    record = json.loads((jobs["job"] / "trackers" / "wandb.json").read_text())
    folders = sorted((jobs["job"] / "wandb").glob("offline-run-*"))
    assert len(folders) == 4  # one folder per process, `wandb sync` joins them
    assert {f.name.rsplit("-", 1)[1] for f in folders} == {record["id"]}
    for f in folders:
        assert (f / f"run-{record['id']}.wandb").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.xdist_group("trackers")
def test_credentials_are_never_written(jobs):
    """WANDB_API_KEY and MLFLOW_TRACKING_TOKEN were in every process's environment: not one byte
    of them in the state (its tracker files included) or the events."""
    for state in (jobs["job"], jobs["ref"]):
        for p in state.rglob("*"):
            if p.is_file():
                data = p.read_bytes()
                for secret in SECRETS.values():
                    assert secret.encode() not in data, p
    for run in jobs["runs"]:
        assert not any(secret in json.dumps(e) for e in run for secret in SECRETS.values())


def test_an_eval_logs_its_rows_and_its_score_with_the_interval(home, tmp_path):
    r = run_cli(["eval", "tiny", str(REPO / "examples/data/evals.jsonl"), "--state", str(tmp_path / "e"), "--report-to", "tensorboard"])
    assert r.returncode == 0, r.stderr
    done = events_of(r.stdout)[-1]
    acc, rows = _scalars(tmp_path / "e" / "tensorboard", "rows/done")
    assert [s for s, _ in rows] == list(range(1, done["rows"] + 1))
    got = {tag: acc.Scalars(tag)[0].value for tag in ("result/accuracy", "result/ci95_low", "result/ci95_high")}
    assert got == pytest.approx({"result/accuracy": done["accuracy"], "result/ci95_low": done["ci95"][0],
                                 "result/ci95_high": done["ci95"][1]})


@pytest.mark.slow
def test_a_tracking_server_that_is_down_or_hangs_never_fails_the_job(home, tmp_path):
    """A closed port, then a server that accepts and never answers: each time the job finishes
    as it would without a tracker, with one warning, and TensorBoard beside it still logs."""
    import socket

    hang = socket.socket()
    hang.bind(("127.0.0.1", 0))
    hang.listen(8)
    try:
        for n, uri in enumerate(("http://127.0.0.1:9", f"http://127.0.0.1:{hang.getsockname()[1]}")):
            state = tmp_path / f"s{n}"
            r = run_cli(BASE[:3] + ["--steps", "6", "--state", str(state), "--report-to", "mlflow,tensorboard"],
                        env={"SPILLPACK_MLFLOW_URI": uri, "MLFLOW_HTTP_REQUEST_TIMEOUT": "60", "SPILLPACK_TRACKER_WAIT_S": "3"})
            assert r.returncode == 0, r.stderr
            events = events_of(r.stdout)
            assert [e for e in events if e["event"] == "done"][0]["complete"]
            warnings = [e["message"] for e in events if e["event"] == "warning"]
            assert len(warnings) == 1 and warnings[0].startswith("--report-to mlflow"), warnings
            assert [s for s, _ in _scalars(state / "tensorboard", "train/loss")[1]] == list(range(1, 7))
            assert not (state / "trackers" / "mlflow.json").exists()  # the next process tries again
    finally:
        hang.close()


@pytest.mark.slow
def test_a_bad_tracker_wait_is_refused_before_the_job(home, tmp_path):
    state = tmp_path / "s"
    r = run_cli(BASE[:3] + ["--steps", "2", "--state", str(state), "--report-to", "tensorboard"],
                env={"SPILLPACK_TRACKER_WAIT_S": "soon"})
    assert r.returncode == 1
    assert r.stderr.strip() == ("spillpack: SPILLPACK_TRACKER_WAIT_S='soon' is not a number of seconds from 0 to 3600. "
                                "Try: export SPILLPACK_TRACKER_WAIT_S=30")
    assert not (state / "trackers").exists()


def test_pack_carries_the_trackers_wheels_and_the_bundle_logs_with_them(phome, tmp_path, tiny_home):
    from conftest import clean_env

    job = BASE[:3] + ["--steps", "3", "--state", str(tmp_path / "state"), "--report-to", "tensorboard"]
    r = run_cli(["pack", *job, "-o", str(tmp_path / "b")], timeout=900)
    assert r.returncode == 0, r.stderr
    manifest = json.loads((tmp_path / "b" / "MANIFEST.json").read_text())
    assert manifest["trackers"] == ["tensorboard"]
    carried = sorted(p.name for p in (tmp_path / "b" / "wheels").rglob("*.whl"))
    assert any(w.lower().startswith("tensorboardx-2.6.5-") for w in carried) and any(w.startswith("protobuf-") for w in carried), carried
    assert not any(w.startswith(("numpy-", "torch-")) for w in carried), carried  # the zipapp's own, and the target's
    home = tmp_path / "node" / "home"
    import shutil

    shutil.copytree(tiny_home / "models", home / "models")
    r = subprocess.run([str(tmp_path / "b" / "run.sh")], capture_output=True, text=True, env=clean_env(home), cwd="/", timeout=300)
    assert r.returncode == 0, r.stderr
    installed = list((tmp_path / "b" / ".spillpack").glob("*/*/tensorboardX/__init__.py"))
    assert installed, "the bundle's tensorboardX was not unpacked on first start"
    assert [s for s, _ in _scalars(tmp_path / "state" / "tensorboard", "train/loss")[1]] == [1, 2, 3]
    bundle_bytes = b"".join(p.read_bytes() for p in (tmp_path / "b").rglob("*") if p.is_file() and p.suffix != ".whl")
    assert not any(secret.encode() in bundle_bytes for secret in SECRETS.values())


def test_pack_refuses_wandb_unless_asked_by_name(phome, tmp_path):
    job = BASE[:3] + ["--steps", "3", "--report-to", "wandb"]
    r = run_cli(["pack", *job, "-o", str(tmp_path / "b")])
    one_line(r, "reports to wandb", "--with-tracker wandb")
    assert not (tmp_path / "b").exists()


def test_a_build_is_one_run_with_its_stages_told_apart(home, tmp_path):
    r = run_cli(["build", str(REPO / "examples/data"), "--student", "tiny", "--steps", "5", "--state", str(tmp_path / "b"),
                 "--report-to", "tensorboard"])
    assert r.returncode == 0, r.stderr
    acc, curve = _scalars(tmp_path / "b" / "tensorboard", "tune/train/loss")
    assert [s for s, _ in curve] == [1, 2, 3, 4, 5]
    assert {"eval/base/accuracy", "eval/tuned/accuracy", "eval/rows/done"} <= set(acc.Tags()["scalars"])
    assert not list((tmp_path / "b" / "stages").glob("*/trackers"))  # the stages log into the build's run, not runs of their own


def _mlflow_server(tmp_path):
    """`mlflow server` on 127.0.0.1 (the full MLflow, in .venv-mlflow: make setup), in a session of its own."""
    import socket
    import time
    import urllib.request

    exe = REPO / ".venv-mlflow" / "bin" / "mlflow"
    if not exe.exists():
        pytest.skip("the full MLflow is not installed: make setup builds .venv-mlflow")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "mlflow-server.log", "w")
    p = subprocess.Popen([str(exe), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
                          "--backend-store-uri", f"sqlite:///{tmp_path / 'mlflow.db'}", "--default-artifact-root", str(tmp_path / "art")],
                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                return p, url
        except OSError:
            time.sleep(0.5)
        assert p.poll() is None, (tmp_path / "mlflow-server.log").read_text()[-2000:]
    os.killpg(p.pid, signal.SIGKILL)
    pytest.fail("mlflow server did not answer within 120 s")


@pytest.mark.slow
def test_a_real_mlflow_server_gets_one_run_across_a_preemption_and_a_kill_of_it_leaves_the_job_alone(home, tmp_path):
    from mlflow.tracking import MlflowClient
    from tests.support.jobproc import start

    server, url = _mlflow_server(tmp_path)
    try:
        env = {"SPILLPACK_MLFLOW_URI": url}
        args = BASE[:3] + ["--steps", "12", "--ckpt-every", "4", "--state", str(tmp_path / "s"), "--report-to", "mlflow"]
        rc, events, err = run_until(args, _at(6), env=env)
        assert rc == 75, err
        r = run_cli(args, env=env)
        assert r.returncode == 0, r.stderr
        assert [e["message"] for e in events + events_of(r.stdout) if e["event"] == "warning"] == []
        record = json.loads((tmp_path / "s" / "trackers" / "mlflow.json").read_text())
        client = MlflowClient(tracking_uri=url)
        assert [x.info.run_id for x in client.search_runs([record["experiment_id"]])] == [record["run_id"]]
        history = [(m.step, m.value) for m in client.get_metric_history(record["run_id"], "train/loss")]
        assert sorted(history) == sorted({e["step"]: np.float64(e["loss"]) for e in events + events_of(r.stdout)
                                          if e["event"] == "step"}.items())
        assert client.get_run(record["run_id"]).info.status == "FINISHED"

        # The same job, the server killed after its first checkpoint: the job finishes, exit 0, one warning.
        args = BASE[:3] + ["--steps", "12", "--ckpt-every", "4", "--state", str(tmp_path / "s2"), "--report-to", "mlflow"]
        p = start(args, env=env)
        events = []
        for line in p.stdout:
            events.append(json.loads(line))
            if events[-1]["event"] == "checkpoint" and server.poll() is None:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
        assert p.wait(timeout=300) == 0, p.stderr.read()
        assert [e for e in events if e["event"] == "done"][0]["complete"]
        warnings = [e["message"] for e in events if e["event"] == "warning"]
        assert len(warnings) == 1 and warnings[0].startswith("--report-to mlflow stopped reporting"), warnings
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
