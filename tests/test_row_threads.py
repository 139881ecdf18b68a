"""A tune's micro-batch split by rows across CPU threads (runtime/engines/torch/row_threads.py):
the gradients those of one thread within float32 rounding, bit-identical from run to run at the
same count (with dropout and with checkpointing too), a worker's error raised in the caller, and
end to end a narrow model's tune on two threads that stops and resumes bit-identical."""

import gc
import os
import threading

import numpy as np
import pytest
import torch

from conftest import events_of, run_cli


def _session(threads: int, dropout: float = 0.0, checkpoint: bool = False):
    from runtime.data.train import BatchOrder, collate, load_train_data
    from runtime.engines import OptimSpec
    from runtime.engines.torch.engine import TorchEngine
    from runtime.engines.torch.row_threads import RowThreads
    from runtime.models.lora import LoraSpec, init_tensors
    from runtime.models.ref import resolve_model
    from runtime.models.tiny import ensure_tiny
    from runtime.models.tokenizer import Tokenizer

    md = resolve_model(str(ensure_tiny()))
    spec = LoraSpec(8, 16.0, ("q_proj", "v_proj", "gate_proj", "down_proj"), dropout)
    tensors = init_tensors(md.config, spec, 0)
    tensors = {k: v + 0.01 * np.random.default_rng(1).standard_normal(v.shape).astype(np.float32) for k, v in tensors.items()}
    session = TorchEngine("torch-cpu", base_dtype="float32").train_session(md, spec, tensors, OptimSpec(), seed=3)
    session.rows = RowThreads(threads)
    session.grad_checkpoint = checkpoint
    data = load_train_data("examples/data/train.jsonl", Tokenizer.from_dir(ensure_tiny()), 256)
    order = BatchOrder([len(e.ids) for e in data.examples], 5, 1, 0)
    batches = [collate([data.examples[i] for i in mb], 0) for mb in order.micro_batches(0)]
    targets = sum(int((labels != -100).sum()) for _, labels in batches)
    return session, batches, targets


def _step(threads: int, **kw) -> tuple[float, dict]:
    session, batches, targets = _session(threads, **kw)
    loss, _ = session.forward_backward(batches, targets, 0)
    return loss, {n: session.params[n].grad.clone() for n in session.names}


@pytest.mark.parametrize("kw", [{}, {"dropout": 0.2}, {"checkpoint": True}], ids=["plain", "dropout", "checkpointed"])
def test_rows_on_threads_give_one_threads_gradients_and_the_same_bits_each_time(home, kw):
    torch.set_num_threads(1)
    loss1, one = _step(1, **kw)
    loss3, three = _step(3, **kw)  # 5 rows in parts of 2, 2 and 1
    again_loss, again = _step(3, **kw)
    assert abs(loss3 - loss1) <= 1e-5 * abs(loss1)
    for n in one:
        assert one[n].abs().max() > 0, n
        torch.testing.assert_close(three[n], one[n], rtol=1e-4, atol=1e-7)
        assert torch.equal(three[n], again[n]), n  # run to run: bit-identical
    assert loss3 == again_loss


def test_a_parts_error_is_raised_in_the_caller_and_the_thread_count_restored():
    from runtime.engines.torch.row_threads import RowThreads

    running = set(threading.enumerate())
    rows = RowThreads(2)
    assert rows.parts(5) == [slice(0, 3), slice(3, 5)] and rows.parts(1) == [slice(0, 1)]
    before = torch.get_num_threads()

    def part(i):
        if i == 1:
            raise ValueError("part 1 failed")
        return i, torch.get_num_threads()

    with pytest.raises(ValueError, match="part 1 failed"):
        rows.map(part, [0, 1])
    assert torch.get_num_threads() == before
    assert rows.map(part, [0, 2]) == [(0, 1), (2, 1)]  # both parts ran with one thread per op
    workers = [t for t in set(threading.enumerate()) - running if t.name.startswith("spillpack-rows-")]
    assert len(workers) == 1
    del rows
    gc.collect()
    workers[0].join(timeout=10)
    assert not workers[0].is_alive()  # the worker ends with its RowThreads


def test_a_narrow_models_tune_on_two_threads_stops_and_resumes_bit_identical(home, tmp_path):
    """tiny (128 wide) tunes on the two threads named, not one (a tune splits rows), and a run
    stopped after 3 steps and resumed ends with an adapter bit-identical to one never stopped."""
    from safetensors.numpy import load_file

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs")
    tune = ["tune", "tiny", "examples/data/train.jsonl", "--steps", "5", "--batch", "4", "--engine", "torch-cpu",
            "--dropout", "0.1", "--headless"]
    two = {"SPILLPACK_THREADS": "2", "OMP_NUM_THREADS": ""}
    r = run_cli(tune + ["--state", str(tmp_path / "ref")], env=two)
    assert r.returncode == 0, r.stderr
    start = next(e for e in events_of(r.stdout) if e["event"] == "start")
    assert (start["threads"], start["threads_why"]) == (2, "SPILLPACK_THREADS"), start
    r = run_cli(tune + ["--state", str(tmp_path / "s"), "--stop-after", "3"], env=two)
    assert r.returncode == 0, r.stderr
    r = run_cli(tune + ["--state", str(tmp_path / "s")], env={"OMP_NUM_THREADS": "", "SPILLPACK_THREADS": ""})
    assert r.returncode == 0, r.stderr
    evs = events_of(r.stdout)
    start = next(e for e in evs if e["event"] == "start")
    assert start["threads"] == 2 and start["threads_why"].startswith("kept"), start
    got, want = (load_file(str(tmp_path / s / "adapter" / "adapter_model.safetensors")) for s in ("s", "ref"))
    assert sorted(got) == sorted(want) and all((got[k] == want[k]).all() for k in got)
    one = run_cli(tune + ["--state", str(tmp_path / "one")], env={"SPILLPACK_THREADS": "1", "OMP_NUM_THREADS": ""})
    assert one.returncode == 0, one.stderr
    other = load_file(str(tmp_path / "one" / "adapter" / "adapter_model.safetensors"))  # one thread: the same within rounding
    assert all(np.allclose(other[k], want[k], rtol=1e-3, atol=1e-6) for k in want)


def test_a_held_out_pass_split_by_rows_gives_one_threads_loss_and_the_same_bits_each_time(home):
    torch.set_num_threads(1)
    losses = {}
    for threads in (1, 3, 3):
        session, batches, targets = _session(threads)
        losses.setdefault(threads, []).append(session.evaluate(batches))
        assert all(p.grad is None for p in session.params.values())  # forward only
    (one,), (three, again) = losses[1], losses[3]
    assert three[1] == one[1] == sum(int((labels != -100).sum()) for _, labels in batches)
    assert abs(three[0] - one[0]) <= 1e-5 * abs(one[0]) and three == again
