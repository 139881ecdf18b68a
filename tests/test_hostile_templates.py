"""Chat templates built to take the machine: one filter, operator or method that builds a
gigabyte, values each within bounds that add up, loops that never end, a reach for Python's
internals, a global real templates never call. Each is a refusal naming the template and what
it tried, for that row alone; the machine's memory and the job's time stay bounded.

The CLI test runs every variant in one `run` of a GGUF whose own template switches on the row
(as a hostile file's would), and measures the process's peak memory."""

import json
import shutil

import pytest

from runtime.base.errors import SpillpackError
from tests.support.gguf_files import _tiny_tokenizer, write_minimal
from tests.support.peak import run_with_peak

# name -> (template body, what the refusal says)
HOSTILE = {
    "center": ("{{ 'a'|center(900000000) }}", "the center filter is given 900000000"),
    "indent": ("{{ 'a\nb'|indent(900000000) }}", "the indent filter is given 900000000"),
    "indent_lines": ("{{ ('a\n' * 400000)|indent(3000) }}", "the indent filter would build"),
    "percent_width": ("{{ '%0900000000d' % 1 }}", "a %-format is given 900000000"),
    "percent_star": ("{{ '%*d' % (900000000, 1) }}", "a %-format is given 900000000"),
    "format_width": ("{{ '{:>900000000}'.format(1) }}", "str.format is given 900000000"),
    "format_filter": ("{{ '%0900000000d'|format(1) }}", "the format filter is given 900000000"),
    "repeat_str": ("{% set a = 'a' * 60000000 %}{% set b = a ~ a %}{{ b|length }}", "repeating a value 60000000 times"),
    "double_concat": ("{% set a = 'a' * 600000 %}{% set b = a ~ a %}{% set c = b ~ b %}{{ c|length }}", "~ would build"),
    "double_plus": ("{% set a = 'a' * 600000 %}{% set b = a + a %}{% set c = b + b %}{{ c|length }}", "+ would build"),
    "repeat_list": ("{% set a = [0] * 60000000 %}{{ (a + a)|length }}", "repeating a value 60000000 times"),
    "list_of_refs": ("{% set s = ['a' * 100000] * 100 %}{{ s|join|length }}", "repeating a value 100 times"),
    "join_refs": ("{% set s = ['a' * 100000] * 9 %}{% set t = [s|join] * 9 %}{{ t|join|length }}", "the join filter would build"),
    "replace": ("{{ ('a' * 1000)|replace('a', 'b' * 100000) }}", "the replace filter would build"),
    "str_replace": ("{{ ('a' * 1000).replace('a', 'b' * 100000) }}", "str.replace() would build"),
    "ljust": ("{{ 'a'.ljust(900000000) }}", "ljust() is given 900000000"),
    "block_collects": ("{% set s = 'a' * 1000000 %}{% set x %}{% for i in range(2000) %}{{ s ~ i }}{% endfor %}{% endset %}"
                       "{{ x|length }}", "bytes of values at once"),
    "tojson_indent": ("{{ messages|tojson(indent=900000000) }}", "the tojson filter is given 900000000"),
    "output": ("{% for i in range(3000) %}{{ 'y' * 1000 }}{% endfor %}", "the template writes more than"),
    "nested_loops": ("{% set s = 'a' * 100000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}", "ran past 1 seconds"),
    "lipsum": ("{{ lipsum(n=3000000) }}", "'lipsum' is undefined"),
    "cycler": ("{{ cycler(1, 2).next() }}", "'cycler' is undefined"),
    "attr_class": ("{{ messages|attr('__class__') }}", "reached for '__class__' of a list"),
    "format_class": ("{{ '{0.__class__}'.format(messages) }}", "reached for '__class__' of a list"),
    "dunder_get": ("{{ messages.__class__.__mro__ }}", "reached for '__class__' of a list"),
    "dunder_missing": ("{{ messages|attr('__globals__') }}", "reached for '__globals__' of a list"),
    "dunder_item": ("{{ messages['__len__'] }}", "reached for '__len__' of a list"),
}
GOOD = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture
def model(home, tmp_path):
    d = tmp_path / "model"
    shutil.copytree(home / "models" / "tiny", d)
    return d


def refusal(model, template: str, monkeypatch) -> str:
    from runtime.models.tokenizer import Tokenizer

    monkeypatch.setenv("SPILLPACK_TEMPLATE_MAX_SECONDS", "1")
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    with pytest.raises(SpillpackError) as e:
        Tokenizer.from_dir(model).apply_chat_template([{"role": "user", "content": "hi"}])
    return e.value.line()


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_template_that_would_build_too_much_or_reach_outside_is_refused_naming_what_it_tried(model, name, monkeypatch):
    template, said = HOSTILE[name]
    line = refusal(model, template, monkeypatch)
    assert f"the chat template of {model} refused the conversation" in line and said in line, line
    assert "\n" not in line and "Try: " in line


def test_the_bounds_are_the_conversations_own_size_plus_the_limit(model, monkeypatch):
    from runtime.models.tokenizer import Tokenizer

    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": GOOD + "{{ messages[0].content }}"}))
    long = "word " * 400_000  # 2 MB: past the 1 MiB a template may add, but the conversation's own
    text = Tokenizer.from_dir(model).apply_chat_template([{"role": "user", "content": long}], add_generation_prompt=True)
    assert text.count("word ") == 2 * 400_000
    monkeypatch.setenv("SPILLPACK_TEMPLATE_MAX_BYTES", "1000")  # the limit is the user's to set
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{{ 'x' * 900 }}"}))
    assert Tokenizer.from_dir(model).apply_chat_template([{"role": "user", "content": "hi"}]) == "x" * 900
    line = refusal(model, "{{ 'x' * 2000 }}", monkeypatch)
    assert "repeating a value 2000 times would build 2000 characters" in line and "(SPILLPACK_TEMPLATE_MAX_BYTES)" in line


@pytest.mark.parametrize("value", ["0", "-5", "lots"])
def test_a_bound_that_is_no_positive_number_is_one_line(model, value, monkeypatch):
    from runtime.models.tokenizer import Tokenizer

    monkeypatch.setenv("SPILLPACK_TEMPLATE_MAX_BYTES", value)
    with pytest.raises(SpillpackError) as e:
        Tokenizer.from_dir(model).apply_chat_template([{"role": "user", "content": "hi"}])
    assert f"SPILLPACK_TEMPLATE_MAX_BYTES={value!r} is not a positive whole number" in e.value.line()


def test_every_hostile_template_in_one_gguf_is_its_rows_error_and_memory_stays_bounded(home, tmp_path):
    """One GGUF whose template switches on the row's text: each variant refused for its own row,
    the good row answered, the job exit 0, no traceback, and the process's peak below 1.5 GB
    (each variant alone took 2.8-4.3 GB, or hung, before the bounds)."""
    tk = _tiny_tokenizer(home / "models" / "tiny")
    branches = "".join(f"{'{% if' if i == 0 else '{% elif'} messages[0].content == {name!r} %}}{body}"
                       for i, (name, (body, _)) in enumerate(sorted(HOSTILE.items())))
    tk["template"] = branches + "{% else %}" + GOOD + "{% endif %}"
    gguf = write_minimal(tmp_path / "hostile.gguf", home / "models" / "tiny", tokenizer=tk)
    rows = tmp_path / "rows.jsonl"
    names = sorted(HOSTILE) + ["fine"]
    rows.write_text("".join(json.dumps({"custom_id": n, "body": {"messages": [{"role": "user", "content": n}], "max_tokens": 2}}) + "\n"
                            for n in names))
    out = tmp_path / "out.jsonl"
    r = run_with_peak(["run", str(gguf), str(rows), "--out", str(out), "--state", str(tmp_path / "s")], tmp_path,
                      env={"SPILLPACK_TEMPLATE_MAX_SECONDS": "1"}, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and "unexpected" not in r.stdout + r.stderr
    lines = {json.loads(x)["custom_id"]: json.loads(x) for x in out.read_text().splitlines()}
    assert sorted(lines) == sorted(names)
    assert lines["fine"]["error"] is None and lines["fine"]["response"]["status_code"] == 200
    for name, (_, said) in HOSTILE.items():
        message = lines[name]["error"]["message"]
        assert "refused the conversation" in message and said in message, (name, message)
    assert r.peak_gb < 1.5, r.peak_gb


def test_a_template_that_fails_for_every_row_is_one_line_for_the_job(home, tmp_path):
    tk = _tiny_tokenizer(home / "models" / "tiny")
    tk["template"] = "{{ messages|attr('__globals__') }}"
    gguf = write_minimal(tmp_path / "hostile.gguf", home / "models" / "tiny", tokenizer=tk)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"custom_id": str(i), "prompt": "hi"}) + "\n" for i in range(3)))
    r = run_with_peak(["run", str(gguf), str(rows), "--state", str(tmp_path / "s")], tmp_path, env={"SPILLPACK_HEADLESS": "0"})
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("spillpack: every row of") and "reached for '__globals__'" in lines[0], r.stderr
