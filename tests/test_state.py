"""The commit protocol of job state, on a real directory."""

import multiprocessing as mp

import orjson
import pytest

from runtime.base.errors import SpillpackError
from runtime.state.jobstate import JobState, StateConflict
from runtime.state.store import LocalStore
from runtime.state.uri import open_store

IDENTITY = {"command": "tune", "lr": 0.0001, "model": "abc"}


def opened(path, identity=IDENTITY):
    s = JobState(LocalStore(path), identity, engine="torch-cpu")
    s.open()
    return s


def test_checkpoint_exists_only_once_committed(tmp_path):
    s = opened(tmp_path)
    s.checkpoints.commit(5, {"a.bin": b"five"})
    # A writer that died after its files but before its commit record:
    s.store.write("checkpoints/00000002-dead/a.bin", b"torn")
    # ... and a torn record from a filesystem that does not write atomically:
    s.store.write("commits/00000003.json", b'{"seq": 3, "kind": "checkp')
    t = opened(tmp_path)
    latest = t.checkpoints.latest()
    assert latest.step == 5 and t.read_file(latest, "a.bin") == b"five"


def test_record_pointing_at_missing_or_damaged_files(tmp_path):
    s = opened(tmp_path)
    s.checkpoints.commit(1, {"a.bin": b"one"})
    c2, _ = s.checkpoints.commit(2, {"a.bin": b"two"})
    s.store.delete(c2.files["a.bin"]["key"])
    assert opened(tmp_path).checkpoints.latest().step == 1  # incomplete: fall back
    c3, _ = s.checkpoints.commit(3, {"a.bin": b"333"})
    s.store.write(c3.files["a.bin"]["key"], b"xyz")  # same size, other bytes
    t = opened(tmp_path)
    with pytest.raises(SpillpackError, match="is damaged"):
        t.read_file(t.checkpoints.latest(), "a.bin")


def test_two_newest_checkpoints_are_kept(tmp_path):
    s = opened(tmp_path)
    for step in range(1, 6):
        s.checkpoints.commit(step, {"a.bin": str(step).encode()})
    commits = [c for c in s.commits() if c.kind == "checkpoint"]
    assert [c.step for c in commits] == [4, 5]
    assert len(s.store.list("checkpoints/")) == 2


def test_another_job_is_refused(tmp_path):
    opened(tmp_path).checkpoints.commit(1, {"a.bin": b"x"})
    with pytest.raises(SpillpackError, match="holds a different job: lr is 0.0001 there and 0.001 here"):
        opened(tmp_path, {**IDENTITY, "lr": 0.001})


def _race(path, barrier, results, i):
    s = JobState(LocalStore(path), IDENTITY, engine="torch-cpu")
    s.open()
    barrier.wait()
    try:
        s.checkpoints.commit(10 + i, {"a.bin": f"writer {i}".encode()})
        results.put(("won", i))
    except StateConflict:
        results.put(("lost", i))


def test_racing_writers_exactly_one_wins(tmp_path):
    opened(tmp_path)
    ctx = mp.get_context("fork")
    barrier, results = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=_race, args=(tmp_path, barrier, results, i)) for i in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    outcome = sorted(results.get() for _ in procs)
    winners = [i for what, i in outcome if what == "won"]
    assert len(winners) == 1
    t = opened(tmp_path)
    latest = t.checkpoints.latest()
    assert t.read_file(latest, "a.bin") == f"writer {winners[0]}".encode()


def test_segments_and_history(tmp_path):
    s = opened(tmp_path)
    s.rows.commit(b'{"custom_id": "a"}\n', 1)
    s.rows.commit(b'{"custom_id": "b"}\n', 1)
    s.log("interrupted", signal="SIGTERM", step=2)
    t = opened(tmp_path)
    assert [t.read_file(c, "rows") for c in t.rows.all()] == [b'{"custom_id": "a"}\n', b'{"custom_id": "b"}\n']
    whats = [h["what"] for h in t.history()]
    assert whats == ["open", "checkpoint", "checkpoint", "interrupted", "open"]
    assert all(h["engine"] == "torch-cpu" and h["host"] for h in t.history())


def test_file_uri(tmp_path):
    store = open_store(f"file://{tmp_path}/st")
    assert store.create("k", b"1") and not store.create("k", b"2")
    assert store.read("k") == b"1"
    assert store.list("") == ["k"]


def test_uri_schemes_are_parsed_in_one_place(tmp_path):
    from pathlib import Path

    from runtime.state.store import local_file

    assert local_file("qwen2.5:0.5b") == Path("qwen2.5:0.5b")  # a tag or a path with a colon, not a URI
    assert local_file(f"file://{tmp_path}/x") == tmp_path / "x"
    assert local_file("s3://bucket/key") is None
    with pytest.raises(SpillpackError, match=r"unsupported URI scheme http:// in http://example/x"):
        local_file("http://example/x")
    with pytest.raises(SpillpackError, match="unsupported URI scheme"):
        open_store("gs://bucket/state")
