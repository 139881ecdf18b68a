"""Hostile records: a job's state, config and data edited by hand or written by
something else. Each test runs the CLI as a user does, on the tiny model and real files."""

import json
import os

import pytest

from conftest import events_of, run_cli, one_line

CHAT = [{"messages": [{"role": "user", "content": f"say {w}"}, {"role": "assistant", "content": w}]}
        for w in ("yes", "no", "maybe", "never", "always", "soon")]


def jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def data(tmp_path):
    return jsonl(tmp_path / "train.jsonl", CHAT)


# -- a commit record whose step disagrees with its checkpoint ----------------------------------------


def test_a_commit_record_whose_step_was_edited_is_passed_over_and_the_job_continues_from_the_one_before(home, data, tmp_path):
    state = tmp_path / "s"
    args = ["tune", "tiny", data, "--steps", "6", "--ckpt-every", "2", "--state", str(state)]
    assert run_cli([*args, "--stop-after", "4"]).returncode == 0
    newest = sorted((state / "commits").iterdir())[-1]
    record = json.loads(newest.read_text())
    assert record["step"] == 4
    record["step"] = 5  # its checkpoint holds step 4, its log 4 losses
    newest.write_text(json.dumps(record))
    for again in (["resume", str(state)], args):  # resume, and the original command: neither is wedged
        r = run_cli(again)
        assert r.returncode == 0, r.stderr
        ev = events_of(r.stdout)
        if again[0] == "resume":
            restore = next(e for e in ev if e["event"] == "restore")
            assert restore["step"] == 2 and restore["uri"].endswith("00000001.json")
            assert [e["step"] for e in ev if e["event"] == "step"] == [3, 4, 5, 6]
        assert ev[-1]["event"] == "done" and ev[-1]["complete"] and ev[-1]["steps"] == 6
    losses = [json.loads(line)["step"] for line in (state / "adapter" / "train_log.jsonl").read_text().splitlines()]
    assert losses == [1, 2, 3, 4, 5, 6]


def test_a_commit_record_naming_more_steps_than_its_log_is_passed_over(home, data, tmp_path):
    """The same class, the other way round: the record's step and meta.json agree, the log falls short."""
    from runtime.state.jobstate import JobState
    from runtime.state.uri import open_store
    from runtime.jobs.tune_checkpoint import agrees as checkpoint_agrees

    state = tmp_path / "s"
    assert run_cli(["tune", "tiny", data, "--steps", "4", "--ckpt-every", "2", "--state", str(state)]).returncode == 0
    js = JobState(open_store(str(state)), {})
    commits = js.commits()
    assert [checkpoint_agrees(js, c) for c in commits] == [True, True]
    commits[-1].step = 3
    assert not checkpoint_agrees(js, commits[-1])


# -- config files name only what a config has ----------------------------------------------------------


@pytest.mark.parametrize("edit,expect", [
    (lambda c: c.__setitem__("extra_top", 1), "unknown key 'extra_top'"),
    (lambda c: c["options"].__setitem__("config", "other.json"), "unknown option 'config'"),
    (lambda c: c["options"].__setitem__("headless", True), "unknown option 'headless'"),
    (lambda c: c["options"].__setitem__("model", "tiny"), "unknown option 'model'"),
    (lambda c: c["arguments"].__setitem__("steps", 3), "unknown argument 'steps'"),
])
def test_a_config_with_a_key_it_does_not_have_is_one_line(home, data, tmp_path, edit, expect):
    cfg = tmp_path / "job.json"
    assert run_cli(["tune", "tiny", data, "--steps", "2", "--state", str(tmp_path / "s"), "--emit-config", str(cfg)]).returncode == 0
    config = json.loads(cfg.read_text())
    edit(config)
    cfg.write_text(json.dumps(config))
    one_line(run_cli(["tune", "--config", str(cfg)]), str(cfg), expect)
    assert not (tmp_path / "s").exists()


# -- OpenAI fine-tuning's weight on assistant messages -------------------------------------------------


def test_an_assistant_message_with_weight_0_is_not_trained_and_weight_1_is(home):
    from runtime.data.train import load_train_data
    from runtime.models.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(home / "models" / "tiny")
    turns = [{"role": "user", "content": "say yes"}, {"role": "assistant", "content": "yes yes yes"},
             {"role": "user", "content": "say no"}, {"role": "assistant", "content": "no"}]
    path = home.parent / "w.jsonl"
    weighted = [dict(t) for t in turns]
    weighted[1]["weight"] = 0
    weighted[3]["weight"] = 1
    jsonl(path, [{"messages": turns}, {"messages": weighted}])
    plain, zero = load_train_data(str(path), tok, 2048).examples
    assert plain.ids == zero.ids  # the weight changes what is trained, never what the model sees
    first_turn = tok.encode_chat(turns[:2])[1]  # the mask of the conversation up to the first answer
    n = len(first_turn)
    assert sum(plain.mask[:n]) == sum(first_turn) > 0
    assert sum(zero.mask[:n]) == 0  # weight 0: no target in the first answer
    assert zero.mask[n:] == plain.mask[n:] and sum(zero.mask[n:]) > 0  # weight 1: the second answer trains as before


@pytest.mark.parametrize("weight,expect", [
    (0, "has no assistant content to learn from"), (2, "\"weight\": 2 (OpenAI's format takes 0 or 1)"),
    (True, "\"weight\": True"),
])
def test_a_weight_that_leaves_nothing_to_learn_or_is_not_0_or_1_is_one_line(home, tmp_path, weight, expect):
    path = jsonl(tmp_path / "t.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                      {"role": "assistant", "content": "yo", "weight": weight}]}])
    one_line(run_cli(["tune", "tiny", path, "--steps", "1", "--state", str(tmp_path / "s")]), "t.jsonl line 1", expect)
    assert not (tmp_path / "s").exists()


def test_a_weight_on_a_user_message_is_one_line(home, tmp_path):
    path = jsonl(tmp_path / "t.jsonl", [{"messages": [{"role": "user", "content": "hi", "weight": 0},
                                                      {"role": "assistant", "content": "yo"}]}])
    one_line(run_cli(["tune", "tiny", path, "--steps", "1", "--state", str(tmp_path / "s")]), "only assistant messages take")


# -- eval rows -------------------------------------------------------------------------------------------


def test_an_eval_row_with_expected_null_is_refused_like_one_without_expected(home, tmp_path):
    rows = [{"custom_id": "a", "prompt": "say yes", "expected": "yes"}, {"custom_id": "b", "prompt": "say no", "expected": None}]
    path = jsonl(tmp_path / "e.jsonl", rows)
    r = run_cli(["eval", "tiny", path, "--max-tokens", "2", "--state", str(tmp_path / "s")])
    one_line(r, "line 2 (custom_id 'b') has no \"expected\" answer")
    missing = jsonl(tmp_path / "m.jsonl", [rows[0], {"custom_id": "b", "prompt": "say no"}])
    assert one_line(run_cli(["eval", "tiny", missing, "--max-tokens", "2", "--state", str(tmp_path / "t")])).split(" line")[1] == \
        one_line(r).split(" line")[1]
    assert not (tmp_path / "s").exists()


# -- status on a damaged state ---------------------------------------------------------------------------


@pytest.fixture
def finished_state(home, data, tmp_path):
    state = tmp_path / "s"
    assert run_cli(["tune", "tiny", data, "--steps", "2", "--state", str(state)]).returncode == 0
    assert run_cli(["status", str(state)]).returncode == 0
    return state


def test_status_on_a_state_whose_job_json_is_garbage_is_one_line(finished_state):
    (finished_state / "job.json").write_bytes(os.urandom(300))
    one_line(run_cli(["status", str(finished_state)]), "is damaged", "job.json is not a JSON object")


def test_status_on_a_state_whose_commits_are_a_file_of_random_bytes_is_one_line(finished_state):
    import shutil

    shutil.rmtree(finished_state / "commits")
    (finished_state / "commits").write_bytes(os.urandom(300))
    one_line(run_cli(["status", str(finished_state)]), "is damaged", "commits is a file, not the folder")


def test_status_on_a_state_whose_invocation_is_garbage_is_one_line(finished_state):
    (finished_state / "invocation.json").write_bytes(b"\x00\xff garbage")
    one_line(run_cli(["status", str(finished_state)]), "invocation.json is not a JSON object")
