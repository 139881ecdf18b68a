"""A real S3 server for the tests: moto's standalone server over HTTP on 127.0.0.1, and a
fault-injecting proxy in front of it.

Use from any test module:

    from tests.support.s3_fixtures import s3, s3_uri, fault_proxy  # noqa: F401  (pytest fixtures)

    def test_x(s3_uri):           # "s3://spillpack-test/<unique prefix>", AWS_* set for this process
        run_cli([... "--state", s3_uri + "/state"])   # subprocesses inherit the environment

`s3` (session): starts the server on a free port, points AWS_ENDPOINT_URL at it, sets canary
credentials (CANARY_KEY_ID / CANARY_SECRET: a scan for them proves nothing leaked), makes the
bucket, and restores the environment at the end. `s3.client` is a boto3 client for checking.
`fault_proxy` (per test): a FaultProxy forwarding to the server; give its `endpoint` to a
subprocess as AWS_ENDPOINT_URL and tell it what to break.

moto checks If-None-Match and stores the object in two separate steps without a lock, so two
conditional PUTs arriving in the same instant can both pass there (S3 and MinIO decide
atomically). Tests that race two writers use `FaultProxy.serialize`, which forwards matching
requests one at a time: the ordering a linearizable server gives.
"""

from __future__ import annotations

import http.client
import os
import re
import socket
import threading
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

BUCKET = "spillpack-test"
CANARY_KEY_ID = "AKIASPILLPACKCANARY7"
CANARY_SECRET = "spillpack-canary-secret-3f9c2a71d0e84b6c"
AWS_ENV = {
    "AWS_ACCESS_KEY_ID": CANARY_KEY_ID,
    "AWS_SECRET_ACCESS_KEY": CANARY_SECRET,
    "AWS_DEFAULT_REGION": "us-east-1",
    # Never the machine's own AWS files: only what the tests set.
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
}
AWS_CLEARED = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_REGION", "AWS_ENDPOINT_URL_S3", "AWS_RETRY_MODE", "AWS_MAX_ATTEMPTS")


@dataclass
class S3Server:
    endpoint: str
    port: int
    bucket: str
    client: object

    def uri(self, prefix: str = "") -> str:
        return f"s3://{self.bucket}/{prefix}".rstrip("/")

    def keys(self, prefix: str = "") -> list[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return sorted(o["Key"] for p in pages for o in p.get("Contents", []))

    def get(self, key: str) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=key, Body=data)


@pytest.fixture(scope="session")
def s3():
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    with pytest.MonkeyPatch.context() as mp:  # a session's environment, given back as it was
        for k in AWS_CLEARED:
            mp.delenv(k, raising=False)
        for k, v in {**AWS_ENV, "AWS_ENDPOINT_URL": endpoint}.items():
            mp.setenv(k, v)
        client = boto3.session.Session().client("s3")
        client.create_bucket(Bucket=BUCKET)
        try:
            yield S3Server(endpoint, port, BUCKET, client)
        finally:
            server.stop()


@pytest.fixture
def s3_uri(s3, request) -> str:
    """A fresh prefix in the test bucket for this test."""
    name = re.sub(r"[^a-zA-Z0-9-]", "-", request.node.name)[:40]
    return s3.uri(f"{name}-{uuid.uuid4().hex[:6]}")


@pytest.fixture
def fault_proxy(s3):
    proxy = FaultProxy(s3.port)
    yield proxy
    proxy.close()


# -- the fault-injecting proxy -------------------------------------------------------------


@dataclass
class Rule:
    method: str | None
    pattern: re.Pattern
    action: str  # "fail" | "cut" | "stall" | "strip" | "serialize"
    times: int  # how many matching requests it applies to (-1: all)
    status: int = 503
    skip: int = 0  # let this many matching requests through first
    barrier: threading.Barrier | None = None
    arrived: threading.Event = field(default_factory=threading.Event)
    released: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    hits: int = 0

    def release(self) -> None:
        self.released.set()


ERROR_CODES = {500: "InternalError", 503: "SlowDown", 403: "AccessDenied"}


class FaultProxy:
    """HTTP proxy on 127.0.0.1 in front of the S3 server that breaks requests on demand.

    fail(503, times=3, path=...)   answer 500/503/403 with an S3 error body instead of forwarding
    cut(times=2, method="GET")     forward, then send the headers and half the body and drop the connection
                                   (other methods: forward, then drop the connection before answering)
    stall(path=..., skip=1)        hold the matching upload after half its body arrived (or the download after
                                   half its body was sent) until .release(), then drop the connection; an
                                   upload is never forwarded. `.arrived` is set when it is being held.
    strip_conditional()            drop If-None-Match / If-Match: a server that ignores conditional writes
    serialize(path=...)            forward matching requests one at a time
    `log` holds (method, path, status) of every request answered.
    """

    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.rules: list[Rule] = []
        self.log: list[tuple[str, str, int]] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _any(self):
                proxy._handle(self)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _any

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        for r in self.rules:
            r.release()
        self.server.shutdown()
        self.server.server_close()

    def _add(self, method, path, action, times, **kw) -> Rule:
        rule = Rule(method, re.compile(path), action, times, **kw)
        with self._lock:
            self.rules.append(rule)
        return rule

    def fail(self, status: int = 503, times: int = 1, path: str = ".", method: str | None = None, skip: int = 0) -> Rule:
        return self._add(method, path, "fail", times, status=status, skip=skip)

    def cut(self, times: int = 1, path: str = ".", method: str | None = "GET", skip: int = 0) -> Rule:
        return self._add(method, path, "cut", times, skip=skip)

    def stall(self, path: str, method: str | None = "PUT", skip: int = 0) -> Rule:
        return self._add(method, path, "stall", 1, skip=skip)

    def strip_conditional(self) -> Rule:
        return self._add(None, ".", "strip", -1)

    def serialize(self, path: str, method: str | None = "PUT") -> Rule:
        return self._add(method, path, "serialize", -1)

    def gate(self, path: str, count: int = 2, method: str | None = "PUT") -> Rule:
        """Hold the first `count` matching requests until all have arrived, then forward them one at a time."""
        return self._add(method, path, "gate", count, barrier=threading.Barrier(count, timeout=180))

    def count(self, method: str, path: str = ".") -> int:
        pattern = re.compile(path)
        return sum(1 for m, p, _ in self.log if m == method and pattern.search(p))

    def _match(self, method: str, path: str) -> list[Rule]:
        """Every matching passive rule (strip, serialize), and the first matching fault, in the order added."""
        out = []
        with self._lock:
            for r in self.rules:
                if (r.method is None or r.method == method) and r.pattern.search(path) and r.times != 0:
                    if r.action not in ("strip", "serialize") and any(o.action not in ("strip", "serialize") for o in out):
                        continue
                    if r.skip > 0:
                        r.skip -= 1
                        continue
                    if r.times > 0:
                        r.times -= 1
                    r.hits += 1
                    out.append(r)
        return out

    def _read_body(self, h) -> bytes:
        if h.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(h.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while h.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(chunks)
                chunks.append(h.rfile.read(size))
                h.rfile.readline()
        n = int(h.headers.get("Content-Length") or 0)
        return h.rfile.read(n) if n else b""

    def _handle(self, h) -> None:
        method, path = h.command, h.path
        rules = self._match(method, path)
        actions = {r.action: r for r in rules}
        if "stall" in actions and method != "GET":
            # Half the body arrives, then nothing until the test says so; the upload never completes.
            n = int(h.headers.get("Content-Length") or 0)
            h.rfile.read(n // 2)
            rule = actions["stall"]
            rule.arrived.set()
            rule.released.wait(120)
            self._drop(h, method, path)
            return
        body = self._read_body(h)
        if "fail" in actions:
            status = actions["fail"].status
            xml = (f"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>{ERROR_CODES.get(status, 'InternalError')}</Code>"
                   f"<Message>injected by the test proxy</Message></Error>").encode()
            h.send_response(status)
            h.send_header("Content-Type", "application/xml")
            h.send_header("Content-Length", str(len(xml)))
            h.end_headers()
            if method != "HEAD":
                h.wfile.write(xml)
            self.log.append((method, path, status))
            return
        headers = {k: v for k, v in h.headers.items() if k.lower() not in ("expect", "transfer-encoding", "content-length", "connection")}
        if "strip" in actions:
            headers = {k: v for k, v in headers.items() if k.lower() not in ("if-none-match", "if-match")}
        if body or method in ("PUT", "POST"):
            headers["Content-Length"] = str(len(body))
        if "gate" in actions:
            actions["gate"].barrier.wait()
        serial = actions.get("serialize") or actions.get("gate")
        if serial:
            with serial.lock:
                status, resp_headers, data = self._forward(method, path, headers, body)
        else:
            status, resp_headers, data = self._forward(method, path, headers, body)
        if "cut" in actions and method != "GET":
            # The request reached the server and took effect; only the answer is lost.
            self._drop(h, method, path)
            return
        h.send_response(status)
        for k, v in resp_headers:
            if k.lower() not in ("transfer-encoding", "connection", "content-length", "server", "date"):
                h.send_header(k, v)
        length = len(data) if method != "HEAD" else int(dict((k.lower(), v) for k, v in resp_headers).get("content-length", 0))
        h.send_header("Content-Length", str(length))
        h.end_headers()
        if method == "HEAD":
            pass
        elif "stall" in actions and len(data) > 1:
            # Half the download arrives, then nothing until the test says so; then the connection drops.
            h.wfile.write(data[: len(data) // 2])
            h.wfile.flush()
            actions["stall"].arrived.set()
            actions["stall"].released.wait(120)
            self._drop(h, method, path)
            return
        elif "cut" in actions and len(data) > 1:
            h.wfile.write(data[: len(data) // 2])
            h.wfile.flush()
            self._drop(h, method, path)
            return
        else:
            h.wfile.write(data)
        self.log.append((method, path, status))

    def _forward(self, method, path, headers, body):
        conn = http.client.HTTPConnection("127.0.0.1", self.upstream_port, timeout=120)
        try:
            conn.request(method, path, body=body if body or method in ("PUT", "POST") else None, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            return resp.status, resp.getheaders(), data
        finally:
            conn.close()

    def _drop(self, h, method, path) -> None:
        self.log.append((method, path, -1))
        h.close_connection = True
        try:
            h.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
