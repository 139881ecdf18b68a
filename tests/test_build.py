"""`spillpack build`: stages, stops and reruns, bad folders, and that the example task is learned."""

import json
import shutil

import pytest

from tests.conftest import REPO, events_of, run_cli

DATA = REPO / "examples/data"


def small_folder(path, evals=6, train=16, prompts=4):
    path.mkdir()
    for name, n in (("evals.jsonl", evals), ("train.jsonl", train), ("prompts.jsonl", prompts)):
        if n:
            (path / name).write_text("".join((DATA / name).read_text().splitlines(True)[:n]))
    return path


def build(folder, state, *extra, timeout=300):
    r = run_cli(["build", str(folder), "--state", str(state), *extra], timeout=timeout)
    assert r.returncode == 0, r.stderr
    return events_of(r.stdout)


def test_bad_folders_give_one_line(home, tmp_path):
    no_evals = small_folder(tmp_path / "f", evals=0)
    r = run_cli(["build", str(no_evals), "--state", str(tmp_path / "s")])
    assert r.returncode == 1 and "no evals.jsonl" in r.stderr and "Traceback" not in r.stderr
    only_evals = small_folder(tmp_path / "g", train=0, prompts=0)
    r = run_cli(["build", str(only_evals)])
    assert r.returncode == 1 and "neither train.jsonl nor prompts.jsonl" in r.stderr
    r = run_cli(["build", str(no_evals), "--stop-after", "bogus:3"])
    assert r.returncode == 1 and "STAGE" in r.stderr
    prompts_only = small_folder(tmp_path / "h", train=0)
    r = run_cli(["build", str(prompts_only), "--state", str(tmp_path / "s2")])
    assert r.returncode == 1 and "no teacher to answer the prompts" in r.stderr
    r = run_cli(["build", str(small_folder(tmp_path / "i")), "--stop-after", "distill", "--state", str(tmp_path / "s3")])
    assert r.returncode == 1 and "no distill stage" in r.stderr
    r = run_cli(["build", str(tmp_path / "i"), "--stop-after", "evl:2", "--state", str(tmp_path / "s4")])
    assert r.returncode == 1 and "STAGE one of distill, tune, eval, not 'evl:2'" in r.stderr and "Traceback" not in r.stderr
    # A state path the eval stage's --adapter tuned=PATH would read as two adapters: refused before any stage runs.
    odd = tmp_path / "a,b=c"
    r = run_cli(["build", str(tmp_path / "i"), "--steps", "1", "--state", str(odd)])
    assert r.returncode == 1 and "would read as two adapters" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (odd / "stages").exists()


@pytest.mark.slow
def test_build_stopped_in_every_stage_ends_like_an_uninterrupted_one(home, tmp_path):
    folder = small_folder(tmp_path / "f")
    opts = ["--steps", "4", "--max-tokens", "4", "--batch", "2", "--teacher", "tiny"]
    whole = build(folder, tmp_path / "whole", *opts)[-1]
    assert whole["complete"] and list(whole["stages"]) == ["distill", "tune", "eval"]
    assert set(whole["stages"]["eval"]) == {"base", "tuned"} and whole["stages"]["eval"]["tuned"]["rows"] == 6

    state = tmp_path / "stopped"
    for stop in ("distill:2", "tune:2", "tune", "eval:3"):
        done = build(folder, state, *opts, "--stop-after", stop)[-1]
        assert done["event"] == "done" and not done["complete"]
    evs = build(folder, state, *opts)
    assert any(e["event"] == "restore" for e in evs)
    restored = [e["step"] for e in evs if e["event"] == "restore" and e.get("stage") == "eval"]
    assert restored and restored[0] >= 3
    # Only the rest of the eval ran: its 6 rows once for the student and once for the tuned student.
    assert sum(e["event"] == "row" for e in evs) == 12 - restored[0]
    assert evs[-1]["complete"] and evs[-1]["stages"] == whole["stages"]


@pytest.mark.slow
def test_the_eval_stage_scores_as_two_separate_evals_in_one_pass(home, tmp_path):
    """The build's one eval pass (student and tuned student in one batch, one model load) answers
    every row as an eval of the student alone and an eval of the tuned adapter alone do."""
    folder = small_folder(tmp_path / "f", prompts=0)
    opts = ["--max-tokens", "6", "--batch", "4"]
    done = build(folder, tmp_path / "b", "--steps", "6", *opts)[-1]
    rows = [json.loads(x) for x in (tmp_path / "b" / "stages" / "eval" / "results.jsonl").read_text().splitlines()]
    assert [r["model"] for r in rows] == ["tiny", "tuned"] * 6
    for model, extra in (("tiny", []), ("tuned", ["--adapter", str(tmp_path / "b" / "stages" / "tune" / "adapter")])):
        r = run_cli(["eval", "tiny", str(folder / "evals.jsonl"), "--state", str(tmp_path / model), *opts, *extra])
        assert r.returncode == 0, r.stderr
        alone = [json.loads(x) for x in (tmp_path / model / "results.jsonl").read_text().splitlines()]
        mine = [r for r in rows if r["model"] == model]
        assert [(r["custom_id"], r["answer"], r["correct"]) for r in mine] == [(r["custom_id"], r["answer"], r["correct"]) for r in alone]
        score = done["stages"]["eval"]["base" if model == "tiny" else "tuned"]
        assert score["accuracy"] == events_of(r.stdout)[-1]["accuracy"] and score["rows"] == 6


@pytest.mark.slow
def test_example_task_is_learned_and_distilled(home, tmp_path):
    """The tiny model learns the example task in a build, and a tuned teacher's answers,
    distilled into the untuned student, beat the untuned student."""
    folder = tmp_path / "task"
    folder.mkdir()
    for name in ("evals.jsonl", "train.jsonl"):
        shutil.copy(DATA / name, folder / name)
    done = build(folder, tmp_path / "b1", timeout=1800)[-1]
    before, after = done["stages"]["eval"]["base"]["accuracy"], done["stages"]["eval"]["tuned"]["accuracy"]
    assert after >= before + 0.4, (before, after)

    distill_folder = tmp_path / "distill"
    distill_folder.mkdir()
    for name in ("evals.jsonl", "prompts.jsonl"):
        shutil.copy(DATA / name, distill_folder / name)
    teacher = str(tmp_path / "b1/stages/tune/adapter")
    d = build(distill_folder, tmp_path / "b2", "--teacher-adapter", teacher, timeout=1800)[-1]
    assert d["stages"]["distill"]["examples"] > 0
    assert d["stages"]["eval"]["tuned"]["accuracy"] >= d["stages"]["eval"]["base"]["accuracy"] + 0.3, d["stages"]


@pytest.mark.slow
def test_build_with_a_held_out_split_scores_the_best_adapter(home, tmp_path):
    folder = small_folder(tmp_path / "f", evals=2, prompts=0)
    done = build(folder, tmp_path / "s", "--steps", "4", "--max-tokens", "2", "--batch", "2", "--val-fraction", "0.3")[-1]
    tune = done["stages"]["tune"]
    assert done["complete"] and tune["best_step"] in (4,) and tune["best_val_loss"] > 0 and tune["stopped_early"] is False
    eval_stage = json.loads((tmp_path / "s" / "stages" / "eval" / "invocation.json").read_text())
    assert eval_stage["options"]["adapter"].startswith("tuned=") and eval_stage["options"]["adapter"].endswith("stages/tune/adapter/best")
    assert (tmp_path / "s" / "stages" / "tune" / "adapter" / "best" / "adapter_model.safetensors").is_file()
