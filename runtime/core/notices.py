"""Preemption notices that come without a signal: the cloud's instance metadata says the
machine is about to be taken (AWS spot `instance-action`, GCP `instance/preempted`).

A daemon thread polls it and, on a notice, asks the job's `Preemption` to stop, exactly as
SIGTERM would. `auto` first asks, with short timeouts, which metadata server answers; where
none does (a laptop, a Slurm node, a pod) the thread ends after one failed connect and
costs nothing more. Nothing here ever delays the job: all of it runs beside it.

`SPILLPACK_METADATA_URL` replaces the metadata address (both clouds' paths are asked
under it) and `SPILLPACK_NOTICE_POLL_S` the poll interval: the tests serve a fake metadata
server on 127.0.0.1 this way.
"""

import os
import threading
import urllib.error
import urllib.request

MODES = ("auto", "aws", "gcp", "off")
# GCP's metadata.google.internal is this same address; using the IP avoids a DNS lookup
# that can hang where no such name exists.
METADATA_URL = "http://169.254.169.254"
AWS_TOKEN = "/latest/api/token"
AWS_ACTION = "/latest/meta-data/spot/instance-action"
AWS_PLACE = {"zone": "/latest/meta-data/placement/availability-zone", "instance_type": "/latest/meta-data/instance-type"}
GCP_PREEMPTED = "/computeMetadata/v1/instance/preempted"
GCP_PLACE = {"zone": "/computeMetadata/v1/instance/zone", "instance_type": "/computeMetadata/v1/instance/machine-type"}
POLL_S = 5.0  # AWS's advice for instance-action; its notice comes two minutes ahead
CONNECT_TIMEOUT_S = 0.5  # a link-local server answers in milliseconds, or is not there
TOKEN_TTL_S = 21600

# A proxy from the environment must never see metadata requests.
_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def metadata_url() -> str:
    return os.environ.get("SPILLPACK_METADATA_URL", METADATA_URL).rstrip("/")


def poll_seconds() -> float:
    return float(os.environ.get("SPILLPACK_NOTICE_POLL_S", POLL_S))


def _request(url: str, method: str = "GET", headers: dict | None = None, timeout: float = CONNECT_TIMEOUT_S):
    """(status, headers, body) or None when nothing answered."""
    req = urllib.request.Request(url, method=method, headers=headers or {})
    try:
        with _opener.open(req, timeout=timeout) as r:
            return r.status, r.headers, r.read(4096)
    except urllib.error.HTTPError as e:
        return e.code, e.headers, b""
    except (OSError, ValueError):
        return None


class AwsSpot:
    """IMDSv2: a session token, then `spot/instance-action` (404 until a stop is scheduled)."""

    name = "aws-spot-notice"

    def __init__(self, base: str):
        self.base = base
        self.token: str | None = None

    def _token(self) -> str | None:
        got = _request(self.base + AWS_TOKEN, "PUT", {"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_S)})
        if got and got[0] == 200:
            return got[2].decode().strip()
        return None

    def detect(self) -> bool:
        self.token = self._token()
        if self.token:
            return True
        got = _request(self.base + "/latest/meta-data/")  # an IMDSv1-only instance
        return bool(got and got[0] == 200)

    def notice(self) -> bool:
        headers = {"X-aws-ec2-metadata-token": self.token} if self.token else {}
        got = _request(self.base + AWS_ACTION, headers=headers)
        if got and got[0] == 401:  # the token expired: fetch another and ask again
            self.token = self._token()
            got = _request(self.base + AWS_ACTION, headers={"X-aws-ec2-metadata-token": self.token or ""})
        return bool(got and got[0] == 200 and b"action" in got[2])

    def place(self) -> dict:
        headers = {"X-aws-ec2-metadata-token": self.token} if self.token else {}
        return {"cloud": "aws", **_fields(self.base, AWS_PLACE, headers)}


class GcpPreempted:
    """`instance/preempted` reads TRUE once the VM is being preempted."""

    name = "gcp-preempted-notice"

    def __init__(self, base: str):
        self.base = base

    def _ask(self):
        return _request(self.base + GCP_PREEMPTED, headers={"Metadata-Flavor": "Google"})

    def detect(self) -> bool:
        got = self._ask()
        return bool(got and got[0] == 200 and got[1].get("Metadata-Flavor") == "Google")

    def notice(self) -> bool:
        got = self._ask()
        return bool(got and got[0] == 200 and got[2].strip().upper() == b"TRUE")

    def place(self) -> dict:
        # GCP answers with paths: projects/123/zones/us-central1-a, projects/123/machineTypes/n2-standard-8
        return {"cloud": "gcp", **{k: v.rsplit("/", 1)[-1] for k, v in _fields(self.base, GCP_PLACE, {"Metadata-Flavor": "Google"}).items()}}


def _fields(base: str, paths: dict, headers: dict) -> dict:
    out = {}
    for key, path in paths.items():
        got = _request(base + path, headers=headers)
        if got and got[0] == 200 and got[2].strip():
            out[key] = got[2].decode(errors="replace").strip()
    return out


class NoticeWatcher:
    def __init__(self, mode: str, preemption, base: str | None = None, poll_s: float | None = None, on_place=None):
        if mode not in MODES:
            raise ValueError(mode)
        self.mode = mode
        self.preemption = preemption
        self.base = base or metadata_url()
        self.poll_s = poll_seconds() if poll_s is None else poll_s
        self.source = None  # the provider found, once detection has run
        self.on_place = on_place  # called once with the cloud's zone and instance type, when a server answers
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "NoticeWatcher":
        if self.mode != "off":
            self._thread = threading.Thread(target=self._run, name="spillpack-notices", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _candidates(self):
        if self.mode == "aws":
            return [AwsSpot(self.base)]
        if self.mode == "gcp":
            return [GcpPreempted(self.base)]
        return [AwsSpot(self.base), GcpPreempted(self.base)]

    def _run(self) -> None:
        for provider in self._candidates():
            if self._stop.is_set():
                return
            # An explicit mode polls even if the first ask fails: the server may come up later.
            if self.mode != "auto" or provider.detect():
                self.source = provider
                break
        if self.source is None:
            return
        if self.mode != "auto" and isinstance(self.source, AwsSpot):
            self.source.token = self.source._token()
        if self.on_place is not None:
            try:
                self.on_place(self.source.place())
            except Exception:
                pass  # a note for `status` must never stop the watcher
        while not self._stop.is_set():
            if self.source.notice():
                if not self._stop.is_set():
                    self.preemption.request(self.source.name)
                return
            self._stop.wait(self.poll_s)


def start_watcher(mode: str | None, preemption, on_place=None) -> NoticeWatcher:
    return NoticeWatcher(mode or "auto", preemption, on_place=on_place).start()
