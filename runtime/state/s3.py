"""The Store interface on S3 and S3-compatible servers (MinIO, moto), through boto3.

Credentials, region and endpoint come only from the standard AWS environment and
config files (AWS_ACCESS_KEY_ID, AWS_PROFILE, AWS_DEFAULT_REGION, AWS_ENDPOINT_URL...):
nothing here reads, stores or prints them, so they never reach a config, a bundle,
the state, an event or a log line.

Atomicity: an S3 object appears whole or not at all (a multipart upload becomes visible
only when completed), so `write` is a plain PUT. `create` is a conditional PUT
(`If-None-Match: *`): of several writers racing for one key, the server lets exactly
one through and answers 412 to the others. A server that ignores the header would let
two copies of a job overwrite each other's commits, so `check_writable` probes for it
and refuses such a server.

Retries: botocore retries each request on throttling, 5xx and connection errors with
exponential backoff (mode 'standard', 10 attempts unless AWS_RETRY_MODE /
AWS_MAX_ATTEMPTS say otherwise). Until the endpoint has answered once, a connection that
cannot be made at all (refused, no route, connect timeout) is retried for CONNECT_BUDGET_S
only: an unreachable endpoint is one line within ~10 s, not a minute of backoff. A connection dropped while a response body streams
is outside botocore's reach, so whole-object reads and transfers are retried here too.
"""

from __future__ import annotations

import io
import os
import random
import socket
import tempfile
import threading
import time
import uuid
from pathlib import Path

import boto3
from boto3.s3.transfer import TransferConfig, create_transfer_manager
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionError as BotoConnectionError,
    ConnectTimeoutError,
    EndpointConnectionError,
    IncompleteReadError,
    NoCredentialsError,
    ResponseStreamingError,
)
from s3transfer.exceptions import RetriesExceededError
from urllib3.exceptions import HTTPError as Urllib3Error

from runtime.base.errors import SpillpackError
from runtime.base.fileio import unlink
from runtime.state.store import Store

MB = 1024 * 1024
# Parts of 16 MB, 16 at a time: a 1 GB checkpoint is 64 parts, several in flight per
# connection pool, and no part is below S3's 5 MB minimum.
TRANSFER = TransferConfig(multipart_threshold=16 * MB, multipart_chunksize=16 * MB, max_concurrency=16,
                          num_download_attempts=8, use_threads=True, preferred_transfer_client="classic")
WHOLE_OBJECT_ATTEMPTS = 5
# Errors of a connection that broke after the response began: botocore does not retry these.
STREAM_ERRORS = (IncompleteReadError, ResponseStreamingError, BotoConnectionError, RetriesExceededError, Urllib3Error,
                 ConnectionError, TimeoutError)

# Errors of a connection that was never made; and how long they are retried before the
# endpoint has answered once (a server that answers keeps botocore's full retries).
NO_CONNECTION = (EndpointConnectionError, ConnectTimeoutError)
CONNECT_TIMEOUT_S = 4
CONNECT_BUDGET_S = 10.0

_clients: dict = {}
_clients_lock = threading.Lock()


def client():
    """One boto3 client per process and AWS environment (clients are thread-safe; making one costs ~0.1 s)."""
    env = tuple(os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_ACCESS_KEY_ID",
                                            "AWS_DEFAULT_REGION", "AWS_REGION", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"))
    with _clients_lock:
        if env not in _clients:
            config = Config(
                retries={"mode": os.environ.get("AWS_RETRY_MODE", "standard"),
                         "total_max_attempts": int(os.environ.get("AWS_MAX_ATTEMPTS", "10"))},
                max_pool_connections=32, connect_timeout=CONNECT_TIMEOUT_S, read_timeout=120, tcp_keepalive=True,
            )
            c = boto3.session.Session().client("s3", config=config)
            c.meta.events.register_first("needs-retry.s3", _ConnectBudget().check)
            _clients[env] = c
        return _clients[env]


class _ConnectBudget:
    """Runs before botocore's retry handler. Until the endpoint has answered once, it decides
    the retries of a connection that cannot be made: short waits, and the error itself once
    another attempt would end past CONNECT_BUDGET_S. Anything else it leaves to botocore."""

    def __init__(self):
        self.answered = False
        self.started: float | None = None  # when the first attempt that failed began
        self.failures = 0

    def check(self, response=None, caught_exception=None, **_):
        if response is not None:
            self.answered = True
            return None
        if self.answered or not isinstance(caught_exception, NO_CONNECTION):
            return None
        attempt_s = CONNECT_TIMEOUT_S if isinstance(caught_exception, ConnectTimeoutError) else 0.0
        now = time.monotonic()
        if self.started is None:
            self.started = now - attempt_s
        delay = min(2.0, 0.5 * 2 ** self.failures)
        self.failures += 1
        if now - self.started + delay + attempt_s > CONNECT_BUDGET_S:
            raise caught_exception
        return delay


def parse_uri(uri: str) -> tuple[str, str]:
    """('bucket', 'prefix/') for s3://bucket/prefix; the prefix is '' or ends in '/'."""
    rest = uri[len("s3://"):] if uri.startswith("s3://") else uri
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise SpillpackError(f"{uri} names no bucket", "s3://bucket/prefix")
    prefix = prefix.strip("/")
    return bucket, prefix + "/" if prefix else ""


def _code(e: ClientError) -> str:
    return str(e.response.get("Error", {}).get("Code", ""))


def _status(e: ClientError) -> int:
    return int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)


def _missing(e: ClientError) -> bool:
    return _code(e) in ("NoSuchKey", "404", "NotFound") or (_status(e) == 404 and _code(e) != "NoSuchBucket")


class S3Store(Store):
    def __init__(self, uri: str):
        self.uri = uri.rstrip("/")
        self.bucket, self.prefix = parse_uri(uri)
        self.s3 = client()
        self.transfer = TRANSFER

    def _key(self, key: str) -> str:
        return self.prefix + key

    # -- errors ----------------------------------------------------------------------------

    def _error(self, e: Exception, what: str, key: str = "") -> SpillpackError:
        """A boto error as the one line a user reads. Never includes credentials: only codes, the bucket and keys."""
        where = self.child_uri(key) if key else self.uri
        if isinstance(e, NoCredentialsError):
            return SpillpackError(f"no AWS credentials found for {where}",
                                  "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) on this machine")
        if isinstance(e, NO_CONNECTION):
            return SpillpackError(f"cannot reach the S3 endpoint for {where} ({e.kwargs.get('endpoint_url', 'unknown')})",
                                  f"check AWS_ENDPOINT_URL and the network: aws s3 ls s3://{self.bucket}/")
        if isinstance(e, ClientError):
            code, status = _code(e), _status(e)
            if code == "NoSuchBucket":
                return SpillpackError(f"bucket {self.bucket} does not exist ({where})", f"aws s3 mb s3://{self.bucket}, or another bucket")
            if status == 403 or code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AllAccessDisabled"):
                return SpillpackError(f"access to {where} was denied ({code or status})",
                                      f"check this machine's AWS credentials (aws sts get-caller-identity) and that they may {what} under s3://{self.bucket}/{self.prefix}")
            msg = e.response.get("Error", {}).get("Message", "")
            return SpillpackError(f"S3 {what} of {where} failed: {code or status} {msg}".rstrip(),
                                  f"aws s3 ls {where}, then run the command again")
        return SpillpackError(f"S3 {what} of {where} failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                              f"check the network and AWS_ENDPOINT_URL (aws s3 ls s3://{self.bucket}/), then run the command again")

    def _retrying(self, what: str, key: str, fn):
        """fn() with whole-object retries on broken streams; boto errors become one line."""
        for attempt in range(WHOLE_OBJECT_ATTEMPTS):
            try:
                return fn()
            except NO_CONNECTION as e:  # nothing answers at all: botocore already retried
                raise self._error(e, what, key) from e
            except STREAM_ERRORS as e:
                if attempt == WHOLE_OBJECT_ATTEMPTS - 1:
                    raise self._error(e, what, key) from e
                time.sleep(min(8.0, 0.25 * 2 ** attempt) * random.uniform(0.5, 1.0))
            except (ClientError, BotoCoreError) as e:
                raise self._error(e, what, key) from e

    # -- the Store interface --------------------------------------------------------------------

    def read(self, key):
        def get():
            try:
                r = self.s3.get_object(Bucket=self.bucket, Key=self._key(key))
            except ClientError as e:
                if _missing(e):
                    return None
                raise
            if r["ContentLength"] < self.transfer.multipart_threshold:
                return r["Body"].read()
            r["Body"].close()  # large: parallel ranged GETs instead of one stream
            buf = io.BytesIO()
            with create_transfer_manager(self.s3, self.transfer) as tm:
                tm.download(self.bucket, self._key(key), buf).result()
            return buf.getvalue()

        return self._retrying("read", key, get)

    def read_stream(self, key, consume):
        """One GET streamed into `consume` in pieces of a MiB (a broken stream is read again from
        the start, as `read` retries a whole object)."""
        def get():
            try:
                body = self.s3.get_object(Bucket=self.bucket, Key=self._key(key))["Body"]
            except ClientError as e:
                if _missing(e):
                    return None
                raise
            try:
                return consume(body.iter_chunks(MB))
            finally:
                body.close()

        return self._retrying("read", key, get)

    def write(self, key, data):
        def put():
            if len(data) < self.transfer.multipart_threshold:
                self.s3.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)
            else:
                with create_transfer_manager(self.s3, self.transfer) as tm:
                    tm.upload(io.BytesIO(data), self.bucket, self._key(key)).result()

        self._retrying("write", key, put)

    def create(self, key, data):
        """Conditional PUT. An identical object already there counts as ours: that is what a PUT
        looks like when its first attempt landed and only the answer was lost, and commit records
        carry their writer's id, so two writers never hold identical bytes."""
        if self._put_if_absent(key, data):
            return True
        return self.read(key) == data

    def _put_if_absent(self, key: str, data: bytes) -> bool:
        for attempt in range(WHOLE_OBJECT_ATTEMPTS):
            try:
                self._retrying("create", key, lambda: self.s3.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, IfNoneMatch="*"))
                return True
            except SpillpackError as e:
                cause = e.__cause__
                if not isinstance(cause, ClientError):
                    raise
                if _status(cause) == 412:
                    return False
                if _status(cause) == 409 and attempt < WHOLE_OBJECT_ATTEMPTS - 1:
                    # ConditionalRequestConflict: another conditional write to the key is in flight; ask again.
                    time.sleep(0.2 * 2 ** attempt)
                    continue
                if _status(cause) == 501 or _code(cause) == "NotImplemented":
                    raise self._refuse_unconditional() from cause
                raise
        return False

    def _refuse_unconditional(self) -> SpillpackError:
        endpoint = self.s3.meta.endpoint_url
        return SpillpackError(
            f"the S3 server at {endpoint} does not honour conditional writes (If-None-Match: *), so two copies of a job "
            f"could overwrite each other's commits in {self.uri}",
            "an S3 store with conditional writes (AWS S3, MinIO since 2024-11, Cloudflare R2), or a local --state directory")

    def list(self, prefix):
        return sorted(key for key, _, _ in self.list_meta(prefix))

    def list_meta(self, prefix: str = "") -> list[tuple[str, int, str]]:
        """(key, size, etag) of every object under prefix, keys relative to this store."""
        def ls():
            out = []
            for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self._key(prefix)):
                for o in page.get("Contents", []):
                    out.append((o["Key"][len(self.prefix):], o["Size"], o["ETag"]))
            return out

        return self._retrying("list", prefix, ls)

    def size(self, key):
        def head():
            try:
                return self.s3.head_object(Bucket=self.bucket, Key=self._key(key))["ContentLength"]
            except ClientError as e:
                if _missing(e):
                    return None
                raise

        return self._retrying("stat", key, head)

    def delete(self, key):
        """The object, and everything under key/ (as LocalStore deletes a directory)."""
        def rm():
            self.s3.delete_object(Bucket=self.bucket, Key=self._key(key))
            children = [self._key(k) for k, _, _ in self.list_meta(key.rstrip("/") + "/")]
            for i in range(0, len(children), 1000):
                self.s3.delete_objects(Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in children[i:i + 1000]], "Quiet": True})

        self._retrying("delete", key, rm)

    def put_file(self, key, path):
        def up():
            with create_transfer_manager(self.s3, self.transfer) as tm:
                tm.upload(str(path), self.bucket, self._key(key)).result()

        self._retrying("upload", key, up)

    def get_file(self, key, path):
        """Download to a temporary name beside `path`, then rename: a partial file never has the final name."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)

        def down():
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            os.close(fd)
            try:
                with create_transfer_manager(self.s3, self.transfer) as tm:
                    with open(tmp, "wb") as f:
                        tm.download(self.bucket, self._key(key), f).result()
                os.replace(tmp, path)
                return True
            except ClientError as e:
                if _missing(e):
                    return False
                raise
            finally:
                unlink(tmp)

        return self._retrying("download", key, down)

    def child_uri(self, key):
        return f"s3://{self.bucket}/{self.prefix}{key}".rstrip("/") if key else self.uri

    # -- opening a state here ---------------------------------------------------------------------

    def check_writable(self) -> None:
        """One line for a missing bucket, denied access or a server without conditional writes.

        The probe object is created twice; the second create must fail, or the server ignores
        If-None-Match and the commit protocol would not hold."""
        probe = f".probe-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            first = self._put_if_absent(probe, b"1")
            second = self._put_if_absent(probe, b"2")
        finally:
            try:
                self.s3.delete_object(Bucket=self.bucket, Key=self._key(probe))
            except (ClientError, BotoCoreError):
                pass
        if not first or second:
            raise self._refuse_unconditional()
