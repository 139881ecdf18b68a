"""Preemption notices that come without a signal: the cloud's instance metadata says the
machine is about to be taken (AWS spot `instance-action`, GCP `instance/preempted`, Azure
Scheduled Events' `Preempt`).

A daemon thread polls it and, on a notice, asks the job's `Preemption` to stop, exactly as
SIGTERM would. `auto` first asks, with short timeouts, which metadata server answers; where
none does (a laptop, a Slurm node, a pod) the thread ends after one failed connect and
costs nothing more. Nothing here ever delays the job: all of it runs beside it.

`SPILLPACK_METADATA_URL` replaces the metadata address (both clouds' paths are asked
under it) and `SPILLPACK_NOTICE_POLL_S` the poll interval: the tests serve a fake metadata
server on 127.0.0.1 this way.

Azure differs in two ways: its event names a time (`NotBefore`, often under 10 s away), so
the job's grace is shortened to end before it, and the event is acknowledged (a
`StartRequests` POST) once the checkpoint is committed, so the eviction need not wait for
the deadline (`NoticeWatcher.committed`).
"""

import email.utils
import json
import os
import time
import threading
import urllib.error
import urllib.request

MODES = ("auto", "aws", "gcp", "azure", "off")
# GCP's metadata.google.internal is this same address; using the IP avoids a DNS lookup
# that can hang where no such name exists.
METADATA_URL = "http://169.254.169.254"
AWS_TOKEN = "/latest/api/token"
AWS_ACTION = "/latest/meta-data/spot/instance-action"
AWS_PLACE = {"zone": "/latest/meta-data/placement/availability-zone", "instance_type": "/latest/meta-data/instance-type"}
GCP_PREEMPTED = "/computeMetadata/v1/instance/preempted"
GCP_PLACE = {"zone": "/computeMetadata/v1/instance/zone", "instance_type": "/computeMetadata/v1/instance/machine-type"}
# Azure's documented endpoints; every request carries `Metadata: true` (a request without it is refused).
AZURE_EVENTS = "/metadata/scheduledevents?api-version=2020-07-01"
AZURE_COMPUTE = "/metadata/instance/compute?api-version=2021-02-01"
AZURE_HEADERS = {"Metadata": "true"}
POLL_S = 5.0  # AWS's advice for instance-action; its notice comes two minutes ahead
CONNECT_TIMEOUT_S = 0.5  # a link-local server answers in milliseconds, or is not there
TOKEN_TTL_S = 21600

# A proxy from the environment must never see metadata requests.
_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def metadata_url() -> str:
    return os.environ.get("SPILLPACK_METADATA_URL", METADATA_URL).rstrip("/")


def poll_seconds() -> float:
    return float(os.environ.get("SPILLPACK_NOTICE_POLL_S", POLL_S))


def _request(url: str, method: str = "GET", headers: dict | None = None, timeout: float = CONNECT_TIMEOUT_S,
             data: bytes | None = None):
    """(status, headers, body) or None when nothing answered (the timeout bounds a server that
    accepts and never answers)."""
    req = urllib.request.Request(url, method=method, headers=headers or {}, data=data)
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


class AzurePreempt:
    """Scheduled Events: a `Preempt` event for this VM (its name, from the compute metadata, is
    in the event's Resources). `within_s`: seconds left before its NotBefore, once seen."""

    name = "azure-preempt-notice"

    def __init__(self, base: str):
        self.base = base
        self.vm: str | None = None
        self.compute: dict = {}
        self.event_id: str | None = None
        self.within_s: float | None = None

    def _json(self, path: str):
        got = _request(self.base + path, headers=AZURE_HEADERS)
        if not got or got[0] != 200:
            return None
        try:
            return json.loads(got[2])
        except ValueError:
            return None  # garbage is no notice: the job keeps training

    def detect(self) -> bool:
        compute = self._json(AZURE_COMPUTE)
        if not isinstance(compute, dict):
            return False
        self.compute = compute
        self.vm = compute.get("name") if isinstance(compute.get("name"), str) else None
        return True

    def notice(self) -> bool:
        doc = self._json(AZURE_EVENTS)
        events = doc.get("Events") if isinstance(doc, dict) else None
        for e in events if isinstance(events, list) else []:
            if not isinstance(e, dict) or e.get("EventType") != "Preempt" or not isinstance(e.get("EventId"), str):
                continue
            resources = e.get("Resources")
            if self.vm and isinstance(resources, list) and resources and self.vm not in resources:
                continue  # another VM of the same availability set or scale set
            self.event_id = e["EventId"]
            self.within_s = _seconds_until(e.get("NotBefore"))
            return True
        return False

    def acknowledge(self) -> bool:
        """Tell Azure this VM is ready: the eviction may start now rather than at NotBefore."""
        if self.event_id is None:
            return False
        body = json.dumps({"StartRequests": [{"EventId": self.event_id}]}).encode()
        got = _request(self.base + AZURE_EVENTS, "POST", {**AZURE_HEADERS, "Content-Type": "application/json"}, data=body)
        return bool(got and got[0] == 200)

    def place(self) -> dict:
        if not self.compute:
            self.detect()
        fields = {"zone": self.compute.get("zone") or self.compute.get("location"), "instance_type": self.compute.get("vmSize")}
        return {"cloud": "azure", **{k: v for k, v in fields.items() if isinstance(v, str) and v}}


def _seconds_until(when) -> float | None:
    """Seconds from now to an RFC 1123 time ("Mon, 19 Sep 2016 18:29:47 GMT"); None when absent
    or unreadable (an event already Started has an empty NotBefore)."""
    if not isinstance(when, str) or not when.strip():
        return None
    try:
        return max(0.0, email.utils.parsedate_to_datetime(when).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


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
        self.noticed = False  # a notice asked the job to stop
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

    def committed(self) -> None:
        """The job committed its checkpoint after a notice: acknowledge it where the cloud asks
        for that (Azure), bounded by the metadata timeout. Never raises."""
        ack = getattr(self.source, "acknowledge", None)
        if self.noticed and ack is not None:
            try:
                ack()
            except Exception:
                pass

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _candidates(self):
        if self.mode == "aws":
            return [AwsSpot(self.base)]
        if self.mode == "gcp":
            return [GcpPreempted(self.base)]
        if self.mode == "azure":
            return [AzurePreempt(self.base)]
        return [AwsSpot(self.base), GcpPreempted(self.base), AzurePreempt(self.base)]

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
        if self.mode != "auto" and isinstance(self.source, AzurePreempt):
            self.source.detect()  # the name of this VM, to tell its events from its neighbours' ones
        if self.on_place is not None:
            try:
                self.on_place(self.source.place())
            except Exception:
                pass  # a note for `status` must never stop the watcher
        while not self._stop.is_set():
            if self.source.notice():
                if not self._stop.is_set():
                    self.noticed = True
                    self.preemption.request(self.source.name, within_s=getattr(self.source, "within_s", None))
                return
            self._stop.wait(self.poll_s)


def start_watcher(mode: str | None, preemption, on_place=None) -> NoticeWatcher:
    return NoticeWatcher(mode or "auto", preemption, on_place=on_place).start()
