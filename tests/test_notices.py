"""Preemption notices without a signal: a fake instance-metadata server on 127.0.0.1
announces a spot reclaim and the job checkpoints and exits 75 as it would on SIGTERM.

Nothing here talks to a real metadata address: every job and watcher is pointed at
127.0.0.1 (conftest sets a closed port for all other tests)."""

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from runtime.core.notices import NoticeWatcher
from runtime.base.signals import Preemption
from tests.conftest import REPO, events_of

TOKEN = "fake-imdsv2-token"


class Loopback:
    """A real HTTP server on a free loopback port, serving `handler` from a thread."""

    def serve(self, handler) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


class FakeMetadata(Loopback):
    """AWS IMDSv2 and GCP metadata, as far as the notices are concerned. `flavor` picks
    which cloud it pretends to be; `notice` flips the answer."""

    def __init__(self, flavor: str):
        self.flavor = flavor
        self.notice = False
        self.asked: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code, body=b"", headers=None):
                self.send_response(code)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_PUT(self):
                outer.asked.append("PUT " + self.path)
                if outer.flavor == "aws" and self.path == "/latest/api/token" \
                        and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                    return self._send(200, TOKEN.encode())
                self._send(404)

            def do_GET(self):
                outer.asked.append("GET " + self.path)
                if outer.flavor == "aws" and self.path == "/latest/meta-data/spot/instance-action":
                    if self.headers.get("X-aws-ec2-metadata-token") != TOKEN:
                        return self._send(401)
                    if not outer.notice:
                        return self._send(404)
                    return self._send(200, json.dumps({"action": "terminate", "time": "2030-01-01T00:02:00Z"}).encode())
                if outer.flavor == "gcp" and self.path == "/computeMetadata/v1/instance/preempted":
                    if self.headers.get("Metadata-Flavor") != "Google":
                        return self._send(403)
                    return self._send(200, b"TRUE" if outer.notice else b"FALSE", {"Metadata-Flavor": "Google"})
                self._send(404)

        self.serve(Handler)


@pytest.fixture
def fake_metadata():
    made = []

    def make(flavor):
        made.append(FakeMetadata(flavor))
        return made[-1]

    yield make
    for m in made:
        m.close()


def wait_until(pred, timeout=60.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.05)
    return False


class Recorder:
    """Stands where the job's Preemption stands, to see what the watcher asks of it."""

    def __init__(self):
        self.requests = []

    def request(self, name, within_s=None):
        self.requests.append(name)
        self.within_s = within_s


@pytest.mark.parametrize("flavor,mode,name", [("aws", "auto", "aws-spot-notice"), ("gcp", "auto", "gcp-preempted-notice"),
                                              ("aws", "aws", "aws-spot-notice"), ("gcp", "gcp", "gcp-preempted-notice")])
def test_watcher_requests_a_stop_on_a_notice(fake_metadata, flavor, mode, name):
    md = fake_metadata(flavor)
    rec = Recorder()
    w = NoticeWatcher(mode, rec, base=md.url, poll_s=0.05).start()
    assert wait_until(lambda: len(md.asked) >= 3)
    assert rec.requests == []  # polling, no notice yet
    md.notice = True
    w.join(30)
    assert not w.running
    assert rec.requests == [name]  # once, then the thread ends
    if flavor == "aws":
        assert "PUT /latest/api/token" in md.asked  # IMDSv2: token first


def test_auto_without_a_metadata_server_stops_at_once():
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there: connection refused
    rec = Recorder()
    w = NoticeWatcher("auto", rec, base=f"http://127.0.0.1:{port}", poll_s=0.05).start()
    w.join(30)
    assert not w.running and w.source is None and rec.requests == []


def test_auto_with_a_silent_server_gives_up_after_the_timeout():
    """A server that accepts and never answers (what a firewall may look like) must not
    keep the watcher, let alone the job, waiting."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    try:
        rec = Recorder()
        w = NoticeWatcher("auto", rec, base=f"http://127.0.0.1:{s.getsockname()[1]}", poll_s=0.05).start()
        w.join(30)
        assert not w.running and w.source is None and rec.requests == []
    finally:
        s.close()


def test_off_starts_nothing(fake_metadata):
    md = fake_metadata("aws")
    md.notice = True
    w = NoticeWatcher("off", Recorder(), base=md.url).start()
    assert not w.running and md.asked == []


def test_a_request_after_the_job_closed_is_dropped(fake_metadata):
    """The watcher may see a notice just as the job finishes: the default SIGTERM action
    must not kill the process then."""
    p = Preemption().install()
    p.uninstall()
    t = threading.Thread(target=p.request, args=("aws-spot-notice",))
    t.start()
    t.join()
    assert not p.stop_requested


@pytest.mark.slow
def test_tune_checkpoints_and_exits_75_on_a_notice(home, tmp_path, fake_metadata):
    """End to end with AWS (GCP differs only in the provider, tested above)."""
    flavor = "aws"
    md = fake_metadata(flavor)
    state = tmp_path / "state"
    env = {"SPILLPACK_HEADLESS": "1", "SPILLPACK_METADATA_URL": md.url, "SPILLPACK_NOTICE_POLL_S": "0.1"}
    import os

    cmd = [sys.executable, "-m", "spillpack", "tune", "tiny", "examples/data/train.jsonl", "--steps", "300",
           "--state", str(state), "--ckpt-every", "1000", "--preemption-notice", "auto"]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    try:
        for line in proc.stdout:  # wait for a finished step, so there is work to checkpoint
            lines.append(line)
            if json.loads(line)["event"] == "step":
                break
        md.notice = True  # no signal is sent to the job
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    events = events_of("".join(lines) + out)
    assert proc.returncode == 75, err[-2000:]
    kinds = [e["event"] for e in events]
    assert kinds[-2:] == ["checkpoint", "preempted"]
    pre = events[-1]
    assert pre["signal"] == ("aws-spot-notice" if flavor == "aws" else "gcp-preempted-notice")
    assert 0 < pre["step"] < 300
    assert events[-2]["step"] == pre["step"]
    # The same command resumes from that checkpoint (and the notice is gone).
    md.notice = False
    again = subprocess.run(cmd + ["--stop-after", str(pre["step"] + 2)], cwd=REPO, env={**os.environ, **env},
                           capture_output=True, text=True, timeout=300)
    ev2 = events_of(again.stdout)
    assert again.returncode == 0, again.stderr[-2000:]
    assert [e["step"] for e in ev2 if e["event"] == "restore"] == [pre["step"]]


# -- Azure Scheduled Events ---------------------------------------------------------------

VM = "spot-vm-7"


class FakeAzure(Loopback):
    """Azure's instance metadata as far as Scheduled Events go: the compute document, the
    events document (a Preempt for `resources` once `notice` is set), the StartRequests POST.
    `garbage` answers bytes that are not JSON; `hang` accepts and never answers."""

    def __init__(self, resources=(VM,), not_before_s: float = 30.0):
        self.notice = False
        self.garbage = False
        self.hang = False
        self.resources = list(resources)
        self.not_before_s = not_before_s
        self.asked: list[str] = []
        self.acks: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code, body=b""):
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _gate(self) -> bool:
                outer.asked.append(f"{self.command} {self.path}")
                if outer.hang:
                    time.sleep(5)
                    return False
                if self.headers.get("Metadata") != "true":  # as Azure does: no header, no answer
                    self._send(400, b'{"error": "Bad request. Required metadata header not specified"}')
                    return False
                if outer.garbage:
                    self._send(200, b"<html>\x00\xffnot json")
                    return False
                return True

            def do_GET(self):
                if not self._gate():
                    return
                if self.path == "/metadata/instance/compute?api-version=2021-02-01":
                    return self._send(200, json.dumps({"name": VM, "location": "westeurope", "zone": "2",
                                                       "vmSize": "Standard_NC24ads_A100_v4"}).encode())
                if self.path == "/metadata/scheduledevents?api-version=2020-07-01":
                    events = []
                    if outer.notice:
                        import email.utils

                        events = [{"EventId": "A123BC45-1234-5678-AB90-ABCDEF123456", "EventStatus": "Scheduled",
                                   "EventType": "Preempt", "ResourceType": "VirtualMachine", "Resources": outer.resources,
                                   "NotBefore": email.utils.formatdate(time.time() + outer.not_before_s, usegmt=True),
                                   "Description": "Virtual machine is being preempted.", "EventSource": "Platform",
                                   "DurationInSeconds": -1}]
                    return self._send(200, json.dumps({"DocumentIncarnation": 2 if outer.notice else 1, "Events": events}).encode())
                self._send(404)

            def do_POST(self):
                if not self._gate():
                    return
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n)
                if self.path == "/metadata/scheduledevents?api-version=2020-07-01":
                    outer.acks.append(json.loads(body))
                    return self._send(200)
                self._send(404)

            def do_PUT(self):
                outer.asked.append(f"PUT {self.path}")
                self._send(404)

        self.serve(Handler)


@pytest.fixture
def azure():
    made = []

    def make(**kw):
        made.append(FakeAzure(**kw))
        return made[-1]

    yield make
    for m in made:
        m.close()


@pytest.mark.parametrize("mode", ["auto", "azure"])
def test_azure_preempt_for_this_vm_requests_a_stop_before_not_before(azure, mode):
    md = azure(not_before_s=12)
    rec = Recorder()
    w = NoticeWatcher(mode, rec, base=md.url, poll_s=0.05).start()
    assert wait_until(lambda: sum("scheduledevents" in a for a in md.asked) >= 2)
    assert rec.requests == []
    md.notice = True
    w.join(30)
    assert rec.requests == ["azure-preempt-notice"]
    assert 8 < rec.within_s <= 12  # the seconds left before NotBefore (one-second resolution in the header)
    assert md.acks == []  # nothing is acknowledged before the checkpoint is committed
    w.committed()
    assert md.acks == [{"StartRequests": [{"EventId": "A123BC45-1234-5678-AB90-ABCDEF123456"}]}]


def test_azure_preempt_of_another_vm_is_not_ours(azure):
    md = azure(resources=["spot-vm-8"])
    md.notice = True
    rec = Recorder()
    w = NoticeWatcher("azure", rec, base=md.url, poll_s=0.05).start()
    assert wait_until(lambda: sum("scheduledevents" in a for a in md.asked) >= 3)
    w.stop()
    w.join(10)
    assert rec.requests == []


@pytest.mark.parametrize("fault", ["garbage", "hang"])
def test_azure_garbage_or_hanging_metadata_is_no_notice_and_bounded(azure, fault):
    """Each ask is bounded by the timeout; once the server behaves, the notice still arrives."""
    md = azure()
    setattr(md, fault, True)
    md.notice = True
    rec = Recorder()
    w = NoticeWatcher("azure", rec, base=md.url, poll_s=0.05).start()
    assert wait_until(lambda: sum("scheduledevents" in a for a in md.asked) >= 2, timeout=30)
    assert rec.requests == [] and w.running
    setattr(md, fault, False)
    w.join(30)
    assert rec.requests == ["azure-preempt-notice"]


def test_preemption_grace_ends_before_the_eviction_time():
    p = Preemption(promise_s=30)
    p.install()
    try:
        p.request("azure-preempt-notice", within_s=6.0)
        assert p.stop_requested and p.promise_s == 6.0 and p.reserve_s == pytest.approx(2.0)
    finally:
        p.uninstall()


@pytest.mark.slow
def test_tune_exits_75_on_an_azure_eviction_with_the_checkpoint_committed(home, tmp_path, azure):
    import os

    md = azure(not_before_s=20)
    state = tmp_path / "state"
    env = {**os.environ, "SPILLPACK_HEADLESS": "1", "SPILLPACK_METADATA_URL": md.url, "SPILLPACK_NOTICE_POLL_S": "0.1"}
    cmd = [sys.executable, "-m", "spillpack", "tune", "tiny", "examples/data/train.jsonl", "--steps", "300",
           "--state", str(state), "--ckpt-every", "1000", "--preemption-notice", "azure"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if json.loads(line)["event"] == "step":
                break
        md.notice = True
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    events = events_of("".join(lines) + out)
    assert proc.returncode == 75, err[-2000:]
    assert [e["event"] for e in events][-2:] == ["checkpoint", "preempted"]
    pre = events[-1]
    assert pre["signal"] == "azure-preempt-notice" and 0 < pre["step"] < 300
    assert pre["grace_s"] <= 20  # the grace ended before NotBefore
    # Committed: the commit record of that step is on disk and the event was acknowledged after it.
    records = [json.loads(p.read_text()) for p in sorted((state / "commits").glob("*.json"))]
    assert records[-1]["kind"] == "checkpoint" and records[-1]["step"] == pre["step"]
    assert md.acks == [{"StartRequests": [{"EventId": "A123BC45-1234-5678-AB90-ABCDEF123456"}]}]
    place = [json.loads(p.read_text()) for p in (state / "history").glob("*.json")]
    assert any(r["what"] == "place" and r.get("cloud") == "azure" and r.get("instance_type") == "Standard_NC24ads_A100_v4" for r in place)
