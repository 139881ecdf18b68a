"""tune's validation: a seeded hash split, the held-out loss against PEFT's on the same rows,
the best adapter kept beside the last, early stopping, and all of it across SIGTERM."""

import json
import signal

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from tests.conftest import REPO, events_of, run_cli
from tests.support.jobproc import run_until
from runtime.data.train import load_train_data
from runtime.data.validation import held_out
from runtime.models.tokenizer import Tokenizer

DATA = REPO / "examples/data/train.jsonl"


def test_the_split_is_a_seeded_hash_of_each_row():
    lines = [line for line in DATA.read_bytes().splitlines() if line.strip()]
    picked = [held_out(line, 0, 0.2) for line in lines]
    assert 0.1 < sum(picked) / len(lines) < 0.3
    assert picked == [held_out(b"  " + line + b"\n", 0, 0.2) for line in lines]  # the row's bytes, not its place or padding
    assert picked[::-1] == [held_out(line, 0, 0.2) for line in lines[::-1]]
    assert picked != [held_out(line, 1, 0.2) for line in lines]  # the seed changes it
    # A larger fraction only adds rows: held out at 0.2 stays held out at 0.5.
    assert all(held_out(line, 0, 0.5) for line, p in zip(lines, picked) if p)


def test_val_loss_equals_peft_on_the_same_rows(home, tmp_path):
    peft = pytest.importorskip("peft")
    from tests.support.hf_fixtures import make_qwen2

    path, hf = make_qwen2(tmp_path / "base")
    out = tmp_path / "out"
    r = run_cli(["tune", str(path), str(DATA), "--steps", "4", "--rank", "4", "--lr", "5e-3", "--val-fraction", "0.2",
                 "--eval-every", "2", "--state", str(tmp_path / "s"), "--out", str(out)])
    assert r.returncode == 0, r.stderr
    events = events_of(r.stdout)
    evals = [e for e in events if e["event"] == "eval"]
    assert [e["step"] for e in evals] == [2, 4]
    done = events[-1]
    assert done["best_step"] == min(evals, key=lambda e: e["val_loss"])["step"] and done["best_adapter"] == str(out / "best")

    tok = Tokenizer.from_dir(path)
    val = load_train_data(str(DATA), tok, 2048, select=lambda line: held_out(line, 0, 0.2))
    train = load_train_data(str(DATA), tok, 2048, select=lambda line: not held_out(line, 0, 0.2))
    assert len(val.examples) + len(train.examples) == 200 and evals[-1]["tokens"] == sum(len(e.ids) for e in val.examples)
    for adapter, step in ((out, 4), (out / "best", done["best_step"])):
        model = peft.PeftModel.from_pretrained(hf, str(adapter)).eval()
        total, targets = 0.0, 0
        with torch.no_grad():
            for e in val.examples:
                logits = model(input_ids=torch.tensor([e.ids])).logits[0, :-1].double()  # (T-1, V)
                keep = torch.tensor(e.mask[1:], dtype=torch.bool)
                total += torch.nn.functional.cross_entropy(logits[keep], torch.tensor(e.ids[1:])[keep], reduction="sum").item()
                targets += int(keep.sum())
        want = total / targets
        got = next(e["val_loss"] for e in evals if e["step"] == step)
        assert abs(got - want) < 1e-5, (adapter, got, want)
        hf = model.unload()
    assert [json.loads(l)["step"] for l in (out / "val_log.jsonl").read_text().splitlines()] == [2, 4]


# A learning rate this high overfits tiny within a few steps, so the held-out loss rises and --early-stop ends it.
EARLY = ["tune", "tiny", str(DATA), "--steps", "40", "--batch", "2", "--lr", "3e-2", "--val-fraction", "0.05", "--eval-every", "2",
         "--early-stop", "2", "--ckpt-every", "3"]


def _outcome(state):
    adapter = state / "adapter"
    evals = [json.loads(line) for line in (adapter / "val_log.jsonl").read_text().splitlines()]
    return (load_file(str(adapter / "adapter_model.safetensors")), load_file(str(adapter / "best" / "adapter_model.safetensors")),
            (adapter / "train_log.jsonl").read_text(), [{k: v for k, v in e.items() if k != "seconds"} for e in evals])  # seconds: the clock


@pytest.mark.slow
def test_early_stop_and_the_best_adapter_survive_sigterm_bit_identical(home, tmp_path):
    ref = run_cli(EARLY + ["--state", str(tmp_path / "ref")], timeout=900)
    assert ref.returncode == 0, ref.stderr
    done = events_of(ref.stdout)[-1]
    assert done["complete"] and done["stopped_early"] and done["steps"] < 40 and done["best_step"] < done["steps"]
    evals = [e for e in events_of(ref.stdout) if e["event"] == "eval"]
    assert evals[-1]["stopped_early"] and evals[-1]["bad_evals"] == 2 and evals[-1]["step"] == done["steps"]

    state = tmp_path / "s"
    args = EARLY + ["--state", str(state)]
    # Stopped after a step whose eval is pending, then (resumed) right after an eval.
    rc, ev, err = run_until(args, lambda e: e["event"] == "step" and e["step"] == 2)
    assert rc == 75, err
    rc, ev, err = run_until(args, lambda e: e["event"] == "eval" and e["step"] == 4)
    assert rc == 75, err
    r = run_cli(args, timeout=900)
    assert r.returncode == 0, r.stderr
    again = events_of(r.stdout)[-1]
    for key in ("steps", "stopped_early", "best_step", "best_val_loss", "final_loss", "evals"):
        assert again[key] == done[key], key
    a, b = _outcome(tmp_path / "ref"), _outcome(state)
    for x, y in zip(a[:2], b[:2]):
        assert x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)
    assert a[2:] == b[2:]
    # The best adapter is not the last one, and status tells the evals.
    assert any(not np.array_equal(a[0][k], a[1][k]) for k in a[0])
    story = events_of(run_cli(["status", str(state), "--headless"]).stdout)
    told = [e for e in story if e["kind"] == "eval"]
    assert [e["step"] for e in told] == [e["step"] for e in evals]


@pytest.mark.parametrize("extra,needle", [
    (["--val-fraction", "1.0"], "--val-fraction must be less than 1"),
    (["--early-stop", "2"], "--early-stop needs held-out rows"),
    (["--val", "VAL", "--val-fraction", "0.1"], "--val and --val-fraction both name held-out rows"),
    (["--val", "EMPTY"], "is empty"),
])
def test_bad_validation_input_is_one_line(home, tmp_path, extra, needle):
    (tmp_path / "empty.jsonl").write_text("\n")
    extra = [str(tmp_path / "empty.jsonl") if x == "EMPTY" else str(DATA) if x == "VAL" else x for x in extra]
    r = run_cli(["tune", "tiny", str(DATA), "--steps", "1", "--state", str(tmp_path / "s"), *extra])
    assert r.returncode in (1, 2)
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("spillpack: ") and needle in line and "Try:" in line, line
    assert not (tmp_path / "s").exists()


def test_the_held_out_pass_is_the_same_on_mlx_and_torch(home):
    """Each engine's evaluate(): the same summed loss and target count on the same rows."""
    pytest.importorskip("mlx.core")
    from runtime.data.validation import eval_batches
    from runtime.engines import OptimSpec
    from runtime.engines.registry import get_engine
    from runtime.models.lora import LoraSpec, init_tensors
    from runtime.models.ref import resolve_model

    md = resolve_model("tiny")
    tok = Tokenizer.from_dir(md.path)
    val = load_train_data(str(DATA), tok, 2048, select=lambda line: held_out(line, 0, 0.05))
    spec = LoraSpec(rank=4, alpha=8.0, targets=("q_proj", "v_proj"), dropout=0.1)  # dropout is off in the held-out pass
    tensors = init_tensors(md.config, spec, 0)
    tensors = {k: (v if "lora_A" in k else np.full(v.shape, 0.01, np.float32)) for k, v in tensors.items()}  # B non-zero
    batches = eval_batches(val.examples, 3, tok.pad_token_id or 0)
    got = {name: get_engine(name).train_session(md, spec, tensors, OptimSpec()).evaluate(batches) for name in ("torch-cpu", "mlx")}
    (a, na), (b, nb) = got["torch-cpu"], got["mlx"]
    assert na == nb == sum(sum(e.mask[1:]) for e in val.examples)
    assert abs(a / na - b / nb) < 1e-4
