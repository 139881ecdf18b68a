"""Many LoRA adapters in one batch on the MLX engine (runtime/engines/mlx/multi_lora.py): each row
answered as a one-adapter MLX run of it answers it, a base row as the base, and the row jobs'
`--adapter NAME=SRC` on `--engine mlx` through the CLI."""

import json

import numpy as np
import pytest

pytest.importorskip("mlx.core")

import mlx.core as mx  # noqa: E402

from runtime.engines.registry import get_engine  # noqa: E402
from runtime.models.ref import resolve_model  # noqa: E402
from tests.conftest import events_of, run_cli  # noqa: E402
from tests.support.hf_fixtures import make_family  # noqa: E402
from tests.test_multi_adapter import SHAPES, answer, check_rows_match_single_runs, family_targets, four, lines, random_adapter  # noqa: E402,F401


@pytest.fixture
def mlx_engine():
    return get_engine("mlx", base_dtype="float32")


def test_tiny_answers_each_row_as_its_adapter_alone(home, mlx_engine):
    check_rows_match_single_runs(resolve_model("tiny"), mlx_engine)


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe", "phi3", "gemma3_text"])
def test_each_family_answers_each_row_as_its_adapter_alone(family, tmp_path, home, mlx_engine):
    path, _ = make_family(family, tmp_path / family)
    check_rows_match_single_runs(resolve_model(str(path)), mlx_engine)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_mixed_forward_logits_equal_each_rows_single_adapter_forward(family, tmp_path, home, mlx_engine):
    """One forward of four rows (the base and three adapters of different targets and ranks; on
    Qwen3-MoE the experts' linears too) against each row's forward with its adapter alone."""
    path, _ = make_family(family, tmp_path / family)
    md = resolve_model(str(path))
    ads = [random_adapter(md.config, t, r, i) for i, (t, r) in enumerate(SHAPES[:3])]
    ids = np.random.default_rng(1).integers(0, 200, size=(4, 9))
    which = [-1, 0, 1, 2]
    mixed = mlx_engine.load_model(md, ads)
    mixed.adapter_rows.set(np.repeat(which, ids.shape[1]))
    got = np.array(mixed(mx.array(ids)))
    base = np.array(mlx_engine.load_model(md)(mx.array(ids)))
    for row, a in enumerate(which):
        alone = mlx_engine.load_model(md, None if a < 0 else ads[a])
        want = np.array(alone(mx.array(ids[row: row + 1])))[0]
        np.testing.assert_allclose(got[row], want, atol=1e-5, rtol=0)
        if a >= 0:  # the adapter changes its row
            assert np.abs(got[row] - base[row]).max() > 1e-3


@pytest.mark.slow
def test_run_cli_on_mlx_answers_each_row_with_its_adapter(four):
    tmp, flags = four
    r = run_cli(["run", "tiny", str(tmp / "rows.jsonl"), "--engine", "mlx", "--batch", "4", *flags, "--state", str(tmp / "many"),
                 "--out", str(tmp / "many.jsonl")])
    assert r.returncode == 0, r.stderr
    assert not [e for e in events_of(r.stdout) if "one adapter per job" in json.dumps(e)]
    many = lines(tmp / "many.jsonl")
    rows = [json.loads(x) for x in (tmp / "rows.jsonl").read_text().splitlines()]
    for row in rows:
        got = many[row["custom_id"]]
        asked = row["body"]["model"]
        if asked == "a9":
            assert got["response"] is None and "a9" in got["error"]["message"]
        else:
            assert got["response"]["body"]["model"] == ("tiny" if asked in ("tiny", "base") else asked)
    # One adapter's rows as a plain one-adapter mlx run answers them.
    (tmp / "a1.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows if x["body"]["model"] == "a1"))
    one = run_cli(["run", "tiny", str(tmp / "a1.jsonl"), "--engine", "mlx", "--adapter", str(tmp / "ad1"), "--state", str(tmp / "one"),
                   "--out", str(tmp / "one.jsonl")])
    assert one.returncode == 0, one.stderr
    alone = lines(tmp / "one.jsonl")
    assert len(alone) >= 2 and all(answer(many[c]) == answer(alone[c]) for c in alone)


def test_eval_on_mlx_scores_each_named_adapter(four):
    tmp, flags = four
    evals = tmp / "evals.jsonl"
    evals.write_text("".join(json.dumps({"custom_id": f"e{j}", "prompt": f"say {j}", "expected": "fir"}) + "\n" for j in range(4)))
    r = run_cli(["eval", "tiny", str(evals), "--engine", "mlx", "--metric", "contains", "--max-tokens", "6", "--state", str(tmp / "ev"),
                 "--out", str(tmp / "ev.jsonl")] + flags[:4])
    assert r.returncode == 0, r.stderr
    done = events_of(r.stdout)[-1]
    assert done["event"] == "done"
    scores = {s["model"]: s for s in done["scores"]}
    assert list(scores) == ["tiny", "a0", "a1"] and all(s["rows"] == 4 for s in scores.values())
    out = [json.loads(x) for x in (tmp / "ev.jsonl").read_text().splitlines()]
    assert len(out) == 12
    for name, s in scores.items():
        assert s["correct"] == sum(x["correct"] for x in out if x["model"] == name)
    table = r.stderr.splitlines()
    assert any(line.startswith("tiny (base)") for line in table) and any(line.startswith("a1 ") for line in table)
