"""Chat templates render exactly as transformers renders them; loss masks cover assistant turns only."""

import pytest

from runtime.base.errors import SpillpackError
from runtime.models.tiny import ensure_tiny
from runtime.models.tokenizer import Tokenizer
from tests.support.hf_fixtures import make_llama_tokenizer


@pytest.fixture(autouse=True, scope="module")
def spillpack_home(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPILLPACK_HOME", str(tmp_path_factory.mktemp("home")))
        yield


@pytest.fixture(scope="module", params=["qwen", "llama"])
def tok_dir(request, tmp_path_factory):
    if request.param == "qwen":
        return ensure_tiny()
    d = tmp_path_factory.mktemp("llama_tok")
    make_llama_tokenizer(d)
    return d


CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
    [
        {"role": "user", "content": "Tell me a story."},
        {"role": "assistant", "content": "Once upon a time, a fox."},
        {"role": "user", "content": "Longer, with ünïcode & <tags>."},
        {"role": "assistant", "content": "  The fox ran.\nThe end.  "},
    ],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
     {"role": "user", "content": "c"}],
]


@pytest.mark.parametrize("gen", [False, True])
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
def test_template_matches_transformers(tok_dir, conv, gen):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tok_dir))
    ours = Tokenizer.from_dir(tok_dir)
    msgs = CONVERSATIONS[conv]
    expected = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    assert ours.apply_chat_template(msgs, add_generation_prompt=gen) == expected
    assert ours.encode(expected) == hf.encode(expected, add_special_tokens=False)


def test_encode_prompt_ends_with_assistant_header(tok_dir):
    ours = Tokenizer.from_dir(tok_dir)
    text = ours.decode(ours.encode_prompt(CONVERSATIONS[0]), skip_special_tokens=False)
    assert text.endswith("<|im_start|>assistant\n") or text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


@pytest.mark.parametrize("conv", [1, 2, 3])
def test_encode_chat_mask_is_assistant_content_and_end_of_turn(tok_dir, conv):
    ours = Tokenizer.from_dir(tok_dir)
    msgs = CONVERSATIONS[conv]
    ids, mask = ours.encode_chat(msgs)
    assert ids == ours.encode(ours.apply_chat_template(msgs)) and len(mask) == len(ids)
    eot = "<|im_end|>" if "<|im_end|>" in ours.chat_template else "<|eot_id|>"
    # The Llama template trims contents; Qwen's keeps them as they are.
    strip = (lambda s: s.strip()) if eot == "<|eot_id|>" else (lambda s: s)
    expected = "".join(strip(m["content"]) + eot for m in msgs if m["role"] == "assistant")
    trained = ours.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)
    assert trained == expected
    # each masked run ends on the end-of-turn token
    eot_id = ours.token_to_id(eot)
    runs_end = [ids[j] for j in range(len(ids)) if mask[j] and (j + 1 == len(ids) or not mask[j + 1])]
    assert runs_end and all(t == eot_id for t in runs_end)


def test_eos_and_pad(tok_dir):
    ours = Tokenizer.from_dir(tok_dir)
    if tok_dir == ensure_tiny():
        assert ours.eos_token_ids == {ours.token_to_id("<|im_end|>"), ours.token_to_id("<|endoftext|>")}
        assert ours.pad_token_id == ours.token_to_id("<|endoftext|>")
    else:
        assert ours.token_to_id("<|eot_id|>") in ours.eos_token_ids
        assert ours.pad_token_id in ours.eos_token_ids


def test_decode_roundtrip_and_specials(tok_dir):
    ours = Tokenizer.from_dir(tok_dir)
    text = "Grüße, world! 123"
    assert ours.decode(ours.encode(text)) == text
    ids = ours.encode("a<|eot_id|>b" if "eot" in ours.chat_template else "a<|im_end|>b")
    assert len(ids) == 3 and ours.decode(ids) == "ab"


def template_dir(tmp_path, template):
    import json
    import shutil

    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ensure_tiny() / f, tmp_path / f)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return Tokenizer.from_dir(tmp_path)


def test_template_not_prefix_stable_is_masked_by_content(tmp_path):
    # Announces the number of turns up front: every earlier rendering changes when a message is added.
    ours = template_dir(tmp_path, "{{ messages|length }} turns\n{% for m in messages %}{{ m.role }}: {{ m.content }}<|im_end|>\n{% endfor %}")
    msgs = CONVERSATIONS[2]
    ids, mask = ours.encode_chat(msgs)
    assert ids == ours.encode(ours.apply_chat_template(msgs))
    trained = ours.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)
    # Each content (its own surrounding spaces where they share a token with it) and its end-of-turn.
    assert trained == "Once upon a time, a fox.<|im_end|> The fox ran.\nThe end.  <|im_end|>"


def test_template_that_rewrites_content_is_refused(tmp_path):
    ours = template_dir(tmp_path, "{{ messages|length }}{% for m in messages %}{{ m.role }}: {{ m.content|upper }}<|im_end|>{% endfor %}")
    with pytest.raises(SpillpackError, match="content is not in its rendering, so its tokens cannot be masked"):
        ours.encode_chat(CONVERSATIONS[2])


def test_raise_exception_in_template_is_a_clean_error(tmp_path):
    import json
    import shutil

    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ensure_tiny() / f, tmp_path / f)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}x"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpillpackError, match="first must be user"):
        Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "assistant", "content": "x"}])
