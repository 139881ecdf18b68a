"""S3Store against a real S3 server (moto over HTTP on 127.0.0.1): the Store contract, conditional
creates, one-line errors, and faults injected on the wire being retried."""

import os
import threading

import pytest

from runtime.base.errors import SpillpackError
from runtime.state.s3 import S3Store
from runtime.state.jobstate import JobState, StateConflict
from runtime.state.uri import open_store
from tests.support.s3_fixtures import fault_proxy, s3, s3_uri  # noqa: F401

BIG = 21 * 1024 * 1024  # above the 16 MB multipart threshold: 2 parts


def big_blob() -> bytes:
    return os.urandom(BIG)


@pytest.fixture
def via_proxy(fault_proxy, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", fault_proxy.endpoint)
    monkeypatch.setenv("AWS_RETRY_MODE", "standard")
    return fault_proxy


def test_store_contract(s3_uri, tmp_path):
    store = open_store(s3_uri)
    assert isinstance(store, S3Store)
    assert store.read("a/b.json") is None and store.size("a/b.json") is None
    store.write("a/b.json", b"hello")
    assert store.read("a/b.json") == b"hello" and store.size("a/b.json") == 5
    assert store.create("a/c.json", b"one") is True
    assert store.create("a/c.json", b"two") is False
    assert store.read("a/c.json") == b"one"
    store.write("d.bin", b"x")
    assert store.list("a/") == ["a/b.json", "a/c.json"]
    assert store.list("") == ["a/b.json", "a/c.json", "d.bin"]
    assert store.child_uri("a/b.json") == s3_uri + "/a/b.json"
    src = tmp_path / "src.bin"
    src.write_bytes(b"file bytes")
    store.put_file("up/src.bin", src)
    assert store.get_file("up/src.bin", tmp_path / "out" / "got.bin") is True
    assert (tmp_path / "out" / "got.bin").read_bytes() == b"file bytes"
    assert store.get_file("up/missing.bin", tmp_path / "nope.bin") is False and not (tmp_path / "nope.bin").exists()
    store.delete("a")  # a "directory", as LocalStore deletes one
    assert store.list("") == ["d.bin", "up/src.bin"]
    # A prefix is not a sibling prefix: s3://b/x does not see s3://b/x2.
    open_store(s3_uri + "2").write("other", b"1")
    assert "other" not in store.list("") and open_store(s3_uri + "2").list("") == ["other"]


def test_large_objects_go_multipart_both_ways(s3, s3_uri, tmp_path):
    store = open_store(s3_uri)
    blob = big_blob()
    store.write("ckpt/state.safetensors", blob)
    head = s3.client.head_object(Bucket=s3.bucket, Key=store._key("ckpt/state.safetensors"))
    assert head["ETag"].strip('"').endswith("-2")  # a multipart upload's ETag: md5-of-parts "-" count
    assert store.read("ckpt/state.safetensors") == blob
    f = tmp_path / "w.safetensors"
    f.write_bytes(blob)
    store.put_file("weights/w.safetensors", f)
    assert store.get_file("weights/w.safetensors", tmp_path / "back.safetensors")
    assert (tmp_path / "back.safetensors").read_bytes() == blob


def test_racing_creates_exactly_one_wins(s3_uri, via_proxy):
    via_proxy.serialize(r"/race/")
    store = open_store(s3_uri)
    results = []
    threads = [threading.Thread(target=lambda i=i: results.append((i, store.create("race/k", f"writer {i}".encode()))))
               for i in range(6)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    winners = [i for i, ok in results if ok]
    assert len(winners) == 1
    assert store.read("race/k") == f"writer {winners[0]}".encode()


def test_two_job_states_racing_one_commit(s3_uri, via_proxy):
    via_proxy.serialize(r"/commits/")
    a = JobState(open_store(s3_uri), {"job": 1})
    b = JobState(open_store(s3_uri), {"job": 1})
    a.open()
    b.open()
    a.checkpoints.commit(1, {"t": b"from a"})
    with pytest.raises(StateConflict) as e:
        b.checkpoints.commit(1, {"t": b"from b"})
    assert "another process committed" in e.value.line()
    latest = JobState(open_store(s3_uri), {"job": 1})
    latest.open()
    assert latest.read_file(latest.checkpoints.latest(), "t") == b"from a"


def test_server_ignoring_conditional_writes_is_refused(s3_uri, via_proxy):
    via_proxy.strip_conditional()
    with pytest.raises(SpillpackError) as e:
        open_store(s3_uri).check_writable()
    line = e.value.line()
    assert "does not honour conditional writes" in line and line.startswith("spillpack: ") and "\n" not in line
    assert open_store(s3_uri).list("") == []  # the probe is cleaned up


def test_missing_bucket_and_denied_access_are_one_line(s3, via_proxy, monkeypatch):
    with pytest.raises(SpillpackError) as e:
        open_store("s3://no-such-bucket-here/state").check_writable()
    assert "bucket no-such-bucket-here does not exist" in e.value.line() and "aws s3 mb s3://no-such-bucket-here" in e.value.line()
    via_proxy.fail(403, times=-1)
    with pytest.raises(SpillpackError) as e:
        open_store(s3.uri("denied")).check_writable()
    assert "access to s3://spillpack-test/denied" in e.value.line() and "denied (AccessDenied)" in e.value.line()
    assert "CANARY" not in e.value.line().upper()


def test_5xx_and_cut_connections_are_retried(s3_uri, via_proxy, tmp_path):
    store = open_store(s3_uri)
    blob = big_blob()
    via_proxy.fail(503, times=3, method="PUT")
    via_proxy.fail(500, times=2, method="POST")  # multipart create / complete
    store.write("big", blob)
    store.write("small", b"small object")
    via_proxy.cut(times=2, method="GET")  # connection dropped mid-body, twice
    assert store.read("small") == b"small object"
    via_proxy.cut(times=3, method="GET")
    assert store.read("big") == blob
    via_proxy.fail(503, times=2, method="GET")
    via_proxy.cut(times=2, method="GET", skip=0)
    assert store.get_file("big", tmp_path / "big") and (tmp_path / "big").read_bytes() == blob
    assert via_proxy.count("PUT", r"/big") >= 2 and any(s == -1 for _, _, s in via_proxy.log)
    assert [p.name for p in tmp_path.iterdir()] == ["big"]  # no temp file left behind


def test_create_whose_answer_was_lost_still_counts_as_won(s3_uri, via_proxy):
    via_proxy.cut(times=1, method="PUT", path=r"/lost")  # the PUT lands, the connection drops before the 200
    store = open_store(s3_uri)
    assert store.create("lost", b"mine") is True
    statuses = [s for m, p, s in via_proxy.log if m == "PUT" and p.endswith("/lost")]
    assert statuses == [-1, 412]  # botocore's retry found the object already there: it was ours
    assert store.create("lost", b"theirs") is False
