"""Rows built to break the reader (JSON nested past what its writer can write back), a property
pass over the batch options (`stop`, `response_format`, `logprobs`/`top_logprobs`, the penalties,
`n`) with every hostile value in one batch, and a finished state rerun in another dtype. Each bad
row is that row's error line, validated with openai's own types; the rest of the batch is answered."""

import json

import pytest

from conftest import events_of, one_line, run_cli
from tests.support.peak import run_with_peak
from tests.test_openai_batch import check_line


def nest_schema(n: int) -> dict:
    s = {"type": "string"}
    for _ in range(n):
        s = {"type": "object", "properties": {"a": s}}
    return s


def nest_content(n: int):
    c = [{"type": "text", "text": "hi"}]
    for _ in range(n):
        c = [c]
    return c


def row(cid: str, **body) -> dict:
    return {"custom_id": cid, "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **body}}


def test_rows_nested_past_the_bound_are_their_own_error_lines(home, tmp_path):
    rows = [row("ok"),
            row("schema", response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": nest_schema(130)}}),
            {"custom_id": "content", "body": {"messages": [{"role": "user", "content": nest_content(300)}], "max_tokens": 3}},
            {**row("expected"), "expected": nest_content(400)},
            row("shallow", response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": nest_schema(8)}})]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    r = run_cli(["run", "tiny", str(data), "--out", str(out), "--state", str(tmp_path / "s")])
    assert r.returncode == 0, r.stderr
    lines = {json.loads(x)["custom_id"]: json.loads(x) for x in out.read_text().splitlines()}
    for cid in ("schema", "content", "expected"):
        err = check_line(lines[cid])
        assert "nests objects and lists more than 100 deep" in err.message and err.param == "body", (cid, err)
    for cid in ("ok", "shallow"):
        assert lines[cid]["error"] is None and check_line(lines[cid]).choices[0].message.content is not None


def test_training_data_nested_past_the_bound_is_one_line(home, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}) + "\n"
                    + json.dumps({"messages": [{"role": "user", "content": nest_content(300)}]}) + "\n")
    one_line(run_cli(["tune", "tiny", str(data), "--steps", "1", "--state", str(tmp_path / "s")]),
             f"{data} line 2 nests objects and lists more than 100 deep")
    assert not (tmp_path / "s").exists()


# -- the batch options, every hostile value in one batch ---------------------------------------------------

HOSTILE_VALUES = [0, -1, 1, 2**31, 2**63, -(2**63), 1e308, -1e308, 0.5, True, None, "", "x" * 100_000, [], {}, [[[[1]]]],
                  {"a": {"b": {"c": 1}}}, ["a"] * 100, ["a", 1], "\u0000\ud7ff\U0010ffff"]
OPTIONS = ["stop", "response_format", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "n", "max_tokens",
           "temperature", "top_p", "seed"]


def test_every_hostile_value_of_every_batch_option_is_answered_or_that_rows_one_line(home, tmp_path):
    rows = [row("plain")]
    for name in OPTIONS:
        for i, value in enumerate(HOSTILE_VALUES):
            body = {name: value}
            if name == "top_logprobs":
                body["logprobs"] = True
            if name == "max_tokens" and isinstance(value, int) and not isinstance(value, bool) and value > 8:
                continue  # a real value: a long answer, not a hostile one (too long for the context is tested elsewhere)
            rows.append(row(f"{name}-{i}", **body))
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    r = run_with_peak(["run", "tiny", str(data), "--out", str(out), "--state", str(tmp_path / "s")], tmp_path, timeout=240)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and "unexpected" not in r.stdout
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["custom_id"] for x in lines] == [x["custom_id"] for x in rows]  # every row once, in order
    answered = refused = 0
    for line in lines:
        got = check_line(line)
        if line["error"] is None:
            answered += 1
        else:
            refused += 1
            assert "\n" not in got.message and got.param, line
    assert answered > 20 and refused > 100, (answered, refused)
    assert r.peak_gb < 1.5, r.peak_gb


# -- one output, one dtype ---------------------------------------------------------------------------


def test_a_finished_state_rerun_in_another_dtype_is_refused_and_auto_keeps_its_dtype(home, tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row(str(i))) + "\n" for i in range(3)))
    state = tmp_path / "s"
    base = ["run", "tiny", str(data), "--state", str(state)]
    first = run_cli([*base, "--dtype", "bfloat16"])
    assert first.returncode == 0, first.stderr
    answers = (state / "results.jsonl").read_bytes()
    one_line(run_cli([*base, "--dtype", "float32"], env={"SPILLPACK_HEADLESS": "0"}),
             "holds 3 rows made in bfloat16; --dtype float32 would put float32 answers beside them", "--force to mix them")
    one_line(run_cli(base, env={"SPILLPACK_HEADLESS": "0", "SPILLPACK_DTYPE": "float32"}),
             "SPILLPACK_DTYPE=float32 would put float32 answers beside them")
    assert (state / "results.jsonl").read_bytes() == answers  # nothing the refusal touched
    again = run_cli([*base, "--dtype", "auto"], env={"SPILLPACK_DTYPE": ""})
    assert again.returncode == 0, again.stderr
    restore = [e for e in events_of(again.stdout) if e["event"] == "restore"]
    assert restore and restore[0]["made_with"] == [{"engine": "torch-cpu", "dtype": "bfloat16"}]
    forced = run_cli([*base, "--dtype", "float32", "--force"])
    assert forced.returncode == 0, forced.stderr
    assert (state / "results.jsonl").read_bytes() == answers


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_state_interrupted_in_one_dtype_refuses_rows_in_another(home, tmp_path, dtype):
    other = {"float32": "bfloat16", "bfloat16": "float32"}[dtype]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row(str(i))) + "\n" for i in range(6)))
    base = ["run", "tiny", str(data), "--state", str(tmp_path / "s"), "--commit-rows", "1"]
    part = run_cli([*base, "--dtype", dtype, "--stop-after", "2"])
    assert part.returncode == 0, part.stderr
    one_line(run_cli([*base, "--dtype", other], env={"SPILLPACK_HEADLESS": "0"}), f"made in {dtype}; --dtype {other}")
    rest = run_cli([*base, "--dtype", dtype])
    assert rest.returncode == 0, rest.stderr
    assert len((tmp_path / "s" / "results.jsonl").read_text().splitlines()) == 6
