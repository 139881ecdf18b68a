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


class FakeMetadata:
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

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


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

    def request(self, name):
        self.requests.append(name)


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
