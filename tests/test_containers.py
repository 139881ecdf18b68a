"""spillpack:cpu run by a real container engine: podman, driven through its Docker-compatible
socket by testcontainers (and by the podman CLI where testcontainers has no verb: kube play).

The base image and spillpack:cpu are prepared once per machine (tests/support/containers.py);
all of these tests run in one pytest worker (one podman service, one image build).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import REPO, events_of, run_cli
from tests.support.s3_fixtures import s3, s3_uri  # noqa: F401  (pytest fixtures)
from tests.support import containers as ct

pytestmark = [pytest.mark.xdist_group("containers")]

DATA = REPO / "examples" / "data"
# 120 steps: on a quiet machine the tune ran from its 8th step to its 30th before podman's stop landed.
TUNE = ["tune", "tiny", "/in/train.jsonl", "--name", "ctr", "--steps", "120", "--batch", "4", "--lr", "2e-3",
        "--warmup", "5", "--targets", "q_proj,v_proj", "--rank", "8", "--ckpt-every", "5"]
# One torch thread in the container and on the host: the same arithmetic in the same order.
THREADS = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="session")
def engine():
    reason = ct.why_not()
    if reason:
        pytest.skip(reason)
    return "podman"


@pytest.fixture(scope="session")
def base(engine):
    return ct.ensure_base()


@pytest.fixture(scope="session")
def image(base):
    return ct.ensure_image(base)


@pytest.fixture(scope="session")
def docker_host(image):
    """podman system service for testcontainers; the reaper's image cannot be pulled here."""
    svc = ct.Service()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DOCKER_HOST", svc.url)
        mp.setenv("TESTCONTAINERS_RYUK_DISABLED", "true")
        try:
            yield svc.url
        finally:
            svc.close()


@pytest.fixture
def volume(engine):
    name = f"spillpack-test-{uuid.uuid4().hex[:10]}"
    ct.podman("volume", "create", name)
    yield name
    ct.podman("volume", "rm", "-f", name, check=False)


def container(image, *command, **kwargs):
    from testcontainers.core.container import DockerContainer

    # A long API timeout: on a loaded 2-core machine podman's service can take over a minute to answer.
    c = (DockerContainer(image, docker_client_kw={"timeout": 600}).with_command(list(command))
         .with_volume_mapping(str(DATA), "/in", "ro"))
    for k, v in THREADS.items():
        c = c.with_env(k, v)
    return c.with_kwargs(**kwargs) if kwargs else c


def wait_exit(c, timeout=600) -> int:
    return c.get_wrapped_container().wait(timeout=timeout)["StatusCode"]


def stdout_of(c) -> str:
    return c.get_logs()[0].decode()


def resume_to_the_end(image, volume) -> list[dict]:
    """The same tune started again on the volume: it must end (exit 0); its events."""
    again = container(image, *TUNE).with_volume_mapping(volume, "/data", "rw")
    again.start()
    try:
        assert wait_exit(again) == 0, again.get_logs()[1].decode()
        return ct.json_lines(stdout_of(again))
    finally:
        again.stop()


def volume_path(volume: str) -> Path:
    return Path(ct.podman("volume", "inspect", "--format", "{{.Mountpoint}}", volume).stdout.strip())


@pytest.fixture(scope="module")
def host_reference(tiny_home, tmp_path_factory):
    """The same tune on the host, uninterrupted: what the container's stopped-and-resumed run must equal."""
    ref = tmp_path_factory.mktemp("host-ref")
    args = [str(DATA / "train.jsonl") if a == "/in/train.jsonl" else a for a in TUNE]
    r = run_cli(args + ["--state", str(ref / "state")], env={"SPILLPACK_HOME": str(tiny_home), **THREADS})
    assert r.returncode == 0, r.stderr
    return ref / "state"


def adapter(state: Path) -> dict:
    return load_file(str(state / "adapter" / "adapter_model.safetensors"))


# --- the image itself ----------------------------------------------------------------------------

def test_image_config_is_unprivileged_headless_with_data_volume(image):
    cfg = json.loads(ct.podman("image", "inspect", image).stdout)[0]["Config"]
    assert cfg["Entrypoint"] == ["spillpack"]
    assert cfg["User"] == "1000:0"
    assert "/data" in cfg["Volumes"]
    env = dict(e.split("=", 1) for e in cfg["Env"])
    assert env["SPILLPACK_HOME"] == "/data" and env["SPILLPACK_HEADLESS"] == "1"


def test_nothing_in_the_image_is_root_only(image):
    """Every file spillpack and its Python use is readable (directories enterable) by any UID."""
    walk = ("import os, stat, sys\n"
            "bad = []\n"
            "for top in ('/opt/spillpack', '/opt/spillpack-app'):\n"
            "    for d, dirs, files in os.walk(top):\n"
            "        for p in [d] + [os.path.join(d, f) for f in files]:\n"
            "            if not os.access(p, os.R_OK | (os.X_OK if os.path.isdir(p) else 0)): bad.append(p)\n"
            "print(len(bad), bad[:5])\n")
    r = ct.podman("run", "--rm", "--user", "54321:0", "--entrypoint", "python3", image, "-c", walk)
    assert r.stdout.split()[0] == "0", r.stdout


def test_second_make_image_reuses_every_layer(image, base):
    before = ct.image_id(image)
    r = ct.make_image(base)
    assert r.returncode == 0, r.stderr[-3000:]
    assert ct.image_id(image) == before
    # Every COPY and RUN step of every stage answered from the cache ("--> Using cache ID").
    lines = r.stderr.splitlines()
    steps = [i for i, l in enumerate(lines) if "STEP" in l and any(f": {verb} " in l for verb in ("COPY", "RUN"))]
    assert len(steps) >= 5, r.stderr[-3000:]
    for i in steps:
        answer = next(l for l in lines[i + 1:] if l.startswith("-->"))
        assert answer.startswith("--> Using cache"), (lines[i], answer)


# --- jobs in a container -------------------------------------------------------------------------

@pytest.mark.slow
def test_sigterm_mid_tune_exits_75_and_resumes_bit_identical_to_the_host(docker_host, image, volume, host_reference):
    c = container(image, *TUNE).with_volume_mapping(volume, "/data", "rw")
    c.start()
    try:
        wrapped = c.get_wrapped_container()
        t0 = time.monotonic()
        while stdout_of(c).count('"event":"step"') < 8:
            assert time.monotonic() - t0 < 300 and c.status != "exited", stdout_of(c) + c.get_logs()[1].decode()
            time.sleep(0.5)
            c.reload()
        wrapped.stop(timeout=30)  # SIGTERM, then SIGKILL after 30 s: the grace a scheduler gives
        assert wait_exit(c) == 75, c.get_logs()[1].decode()
        first = ct.json_lines(stdout_of(c))  # headless by default: every line JSON, no --headless given
    finally:
        c.stop()
    pre = [e for e in first if e["event"] == "preempted"]
    assert len(pre) == 1 and pre[0]["signal"] == "SIGTERM"
    stopped = pre[0]["step"]
    assert 8 <= stopped < 120

    second = resume_to_the_end(image, volume)
    restore = [e for e in second if e["event"] == "restore"]
    assert restore and restore[0]["step"] == stopped
    assert second[-1]["event"] == "done" and second[-1]["complete"]
    state = volume_path(volume) / "jobs" / "ctr"
    ours, ref = adapter(state), adapter(host_reference)
    assert ours.keys() == ref.keys()
    for k in ref:
        assert np.array_equal(ours[k], ref[k]), k
    losses = lambda s: [json.loads(l)["loss"] for l in (s / "adapter" / "train_log.jsonl").read_text().splitlines()]
    assert losses(state) == losses(host_reference)


PS = ("import os\n"
      "for pid in sorted(int(p) for p in os.listdir('/proc') if p.isdigit()):\n"
      "    try:\n"
      "        stat = open(f'/proc/{pid}/stat').read()\n"
      "    except OSError:\n"
      "        continue\n"
      "    rest = stat[stat.rindex(')') + 2:].split()\n"
      "    print(pid, rest[1], rest[0], stat[stat.index('(') + 1:stat.rindex(')')])\n")


@pytest.mark.slow
def test_nproc_in_a_container_stops_every_worker_and_reaps_them(docker_host, image, volume):
    """--nproc 2: spillpack (PID 1) runs torch's elastic agent and two ranks; SIGTERM from `stop`
    stops both ranks at one step, exit 75, with no zombie along the way; the job resumes at one rank."""
    c = container(image, *TUNE, "--nproc", "2").with_volume_mapping(volume, "/data", "rw")
    c.start()
    try:
        t0 = time.monotonic()
        while stdout_of(c).count('"event":"step"') < 5:
            c.reload()
            assert time.monotonic() - t0 < 400 and c.status != "exited", stdout_of(c) + c.get_logs()[1].decode()
            time.sleep(0.5)
        code, out = c.exec(["python3", "-c", PS])
        procs = [line.split(None, 3) for line in out.decode().splitlines()]
        assert code == 0 and len(procs) >= 4, procs  # PID 1, two ranks, the exec'd python3
        assert not [p for p in procs if p[2] == "Z"], procs  # nothing left unreaped
        ranks = [p for p in procs if p[1] == "1"]  # the elastic agent's workers: children of PID 1
        assert len(ranks) == 2, procs
        c.get_wrapped_container().stop(timeout=30)
        assert wait_exit(c) == 75, c.get_logs()[1].decode()
        first = ct.json_lines(stdout_of(c))
    finally:
        c.stop()
    pre = [e for e in first if e["event"] == "preempted"]
    assert len(pre) == 1, first[-3:]
    second = resume_to_the_end(image, volume)
    assert [e["step"] for e in second if e["event"] == "restore"] == [pre[0]["step"]]
    assert second[-1]["event"] == "done" and second[-1]["steps"] == 120


def test_doctor_and_a_tune_as_an_arbitrary_uid_on_a_read_only_root(docker_host, image, volume):
    """OpenShift's way: a random UID in group 0, the root filesystem read-only, /tmp a tmpfs."""
    kw = dict(user="4242:0", read_only=True)
    doc = container(image, "doctor", **kw).with_volume_mapping(volume, "/data", "rw").with_tmpfs_mount("/tmp")
    doc.start()
    try:
        assert wait_exit(doc) == 0, doc.get_logs()[1].decode()
        (d,) = ct.json_lines(stdout_of(doc))
    finally:
        doc.stop()
    assert d["event"] == "doctor" and d["home"] == "/data" and d["engine"] == "torch-cpu"
    assert d["engines"]["torch-cpu"]["usable"]

    tune = (container(image, *TUNE[:5], "--steps", "3", "--ckpt-every", "2", **kw)
            .with_volume_mapping(volume, "/data", "rw").with_tmpfs_mount("/tmp"))
    tune.start()
    try:
        assert wait_exit(tune) == 0, tune.get_logs()[1].decode()
        ev = ct.json_lines(stdout_of(tune))
    finally:
        tune.stop()
    assert ev[-1]["event"] == "done" and ev[-1]["steps"] == 3
    commits = sorted((volume_path(volume) / "jobs" / "ctr" / "commits").glob("*.json"))
    assert commits and all(p.stat().st_uid == 4242 for p in commits)


def test_state_on_s3_from_a_container(docker_host, image, s3, s3_uri):
    """The moto server on the host's loopback, reached with the host's network."""
    env = {k: os.environ[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL")}
    c = container(image, *TUNE[:5], "--steps", "4", "--ckpt-every", "2", "--state", s3_uri + "/state", network_mode="host")
    for k, v in env.items():
        c = c.with_env(k, v)
    c.start()
    try:
        assert wait_exit(c) == 0, c.get_logs()[1].decode()
        ev = ct.json_lines(stdout_of(c))
    finally:
        c.stop()
    assert ev[-1]["event"] == "done" and ev[-1]["steps"] == 4
    prefix = s3_uri.split("/", 3)[3] + "/state/"
    keys = s3.keys(prefix)
    assert any(k.endswith("adapter/adapter_model.safetensors") for k in keys), keys
    assert any("/commits/" in k for k in keys), keys


# --- make image's errors -------------------------------------------------------------------------

def test_make_image_without_an_engine_is_one_line(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in ("make", "sh"):
        (bindir / tool).symlink_to(shutil.which(tool))
    python = os.path.realpath(sys._base_executable)  # not a shim that needs more of PATH
    r = subprocess.run(["make", "-s", "-C", str(REPO), "image", f"PYTHON={python}"], capture_output=True,
                       text=True, env={"PATH": str(bindir), "HOME": str(tmp_path)})
    lines = [l for l in r.stderr.splitlines() if l.startswith("spillpack:")]
    assert r.returncode != 0 and len(lines) == 1, r.stderr
    assert "no container engine on PATH" in lines[0] and "Try: apt-get install podman" in lines[0]


def test_make_image_with_a_base_that_cannot_be_found_tags_nothing(engine):
    tag = f"localhost/spillpack-test-{uuid.uuid4().hex[:8]}:cpu"
    r = subprocess.run([shutil.which("python3"), str(REPO / "docker" / "image.py"), "--base", "localhost/no-such-base:1",
                        "--tag", tag], capture_output=True, text=True, env=ct.engine_env())
    assert r.returncode == 1
    (line,) = r.stderr.strip().splitlines()[-1:]
    assert line.startswith("spillpack: the base image localhost/no-such-base:1 is not here and cannot be pulled"), r.stderr
    assert "Try: make image BASE=" in line
    assert ct.image_id(tag) is None


def test_make_image_on_a_full_disk_is_one_line_and_tags_nothing(image, base, tmp_path):
    """The build context on a 4 MB tmpfs: staging the (cached) wheelhouse meets ENOSPC, the build never starts."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(small)], check=True)
    tag = f"localhost/spillpack-test-{uuid.uuid4().hex[:8]}:cpu"
    try:
        r = subprocess.run([sys.executable, str(REPO / "docker" / "image.py"), "--base", base, "--tag", tag,
                            "--context", str(small)], capture_output=True, text=True,
                           env={**ct.engine_env(), **ct.torch_index_env()}, timeout=900)  # the image fixture's wheelhouse
    finally:
        subprocess.run(["umount", str(small)], check=True)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    line = r.stderr.strip().splitlines()[-1]  # after the engine's own progress lines, if any
    assert line.startswith("spillpack: the disk is full") and "Try: free space there" in line, r.stderr
    assert ct.image_id(tag) is None


# --- the Kubernetes CPU template, played by podman -----------------------------------------------

def as_played_pod(job: dict, env: dict) -> dict:
    """The Job's pod template as a Pod (podman 4.3 plays no `kind: Job`), with what a play needs and
    a cluster would not: restartPolicy OnFailure (podman restarts the container on exit 75, as the
    Job's podFailurePolicy makes a new pod), the host's network (the S3 server is on its loopback),
    and the Secret's values written in (podman's secrets do not take a Kubernetes Secret here).
    Everything else is the template as written: image, entrypoint, env, resources, the PVC at /data."""
    spec = json.loads(json.dumps(job["spec"]["template"]["spec"]))
    spec["restartPolicy"] = "OnFailure"
    spec["hostNetwork"] = True
    (c,) = spec["containers"]
    c["env"] = [e for e in c["env"] if "valueFrom" not in e] + [{"name": k, "value": v} for k, v in env.items()]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": job["metadata"]["name"]}, "spec": spec}


@pytest.mark.slow
def test_kubernetes_cpu_template_played_preempted_once_and_finishing(image, phome, s3, s3_uri, tmp_path):
    import yaml

    ref = f"localhost/spillpack-kp-{uuid.uuid4().hex[:8]}"
    bundle = tmp_path / "kp"
    r = run_cli(["pack", *[str(DATA / "train.jsonl") if a == "/in/train.jsonl" else a for a in TUNE[:3]], "--name", "kp",
                 "--steps", "40", "--batch", "4", "--ckpt-every", "5", "--engine", "torch-cpu", "--state", s3_uri + "/state",
                 "-o", str(bundle), "--scheduler", "kubernetes", "--image", ref])
    assert r.returncode == 0, r.stderr
    assert "FROM ${SPILLPACK_IMAGE}:${FLAVOR}" in (bundle / "Containerfile").read_text()
    job = yaml.safe_load((tmp_path / "kp.k8s-cpu.yaml").read_text())
    assert job["spec"]["template"]["spec"]["containers"][0]["image"] == f"{ref}:cpu"
    # The bundle's image, as the file's own comment says to build it (on the local spillpack image).
    ct.podman("build", "-t", f"{ref}:cpu", "--build-arg", "FLAVOR=cpu", "--build-arg", "SPILLPACK_IMAGE=localhost/spillpack",
              str(bundle))
    env = {k: os.environ[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL")}
    pod = as_played_pod(job, {**env, **THREADS})
    play = tmp_path / "play.yaml"
    play.write_text((tmp_path / "kp.k8s-pvc.yaml").read_text() + "\n---\n" + yaml.safe_dump(pod))
    name = f"{pod['metadata']['name']}-spillpack"
    ct.podman("kube", "play", str(play))
    try:
        t0 = time.monotonic()
        while ct.podman("logs", name, check=False).stdout.count('"event":"step"') < 6:
            assert time.monotonic() - t0 < 300, ct.podman("logs", name, check=False).stderr[-3000:]
            time.sleep(0.5)
        pid = int(ct.podman("inspect", "--format", "{{.State.Pid}}", name).stdout)
        os.kill(pid, 15)  # what the kubelet's SIGTERM is: to the container's PID 1, spillpack itself
        while True:
            status, code, restarts = ct.podman("inspect", "--format", "{{.State.Status}} {{.State.ExitCode}} {{.RestartCount}}",
                                               name).stdout.split()
            if status == "exited" and int(restarts) >= 1:
                break
            assert time.monotonic() - t0 < 600, (status, code, restarts)
            time.sleep(1)
        assert (int(code), int(restarts)) == (0, 1)
        events = [json.loads(l) for l in ct.podman("logs", name).stdout.splitlines() if l.startswith("{")]
    finally:
        ct.podman("kube", "down", str(play), check=False)
        ct.podman("volume", "rm", "-f", "spillpack-kp", check=False)
        ct.podman("rmi", "-f", f"{ref}:cpu", check=False)
    kinds = [e["event"] for e in events]
    assert kinds.count("preempted") == 1 and kinds.count("restore") == 1, kinds
    stopped = next(e for e in events if e["event"] == "preempted")["step"]
    assert next(e for e in events if e["event"] == "restore")["step"] == stopped
    assert events[-1]["event"] == "done" and events[-1]["complete"] and events[-1]["steps"] == 40
