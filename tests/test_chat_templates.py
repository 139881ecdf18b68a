"""The families' chat-template features, rendered by our Jinja environment exactly as
transformers' apply_chat_template renders them, and the assistant-only loss mask for each.

The templates are written here, in the style of each family's own, each using the features
real templates rely on: Qwen3's enable_thinking, namespace, reversed messages, string methods
(startswith, split, strip) and tojson; Gemma's system folded into the first user turn and
raise_exception; Phi's and Mistral's turn markers (Mistral's system prompt on the last user
turn, Phi's eos after a finished conversation).
"""

import json
import shutil

import pytest

from runtime.base.errors import SpillpackError
from runtime.models.tiny import ensure_tiny
from runtime.models.tokenizer import Tokenizer

QWEN3 = """{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not (message.content is string and message.content.startswith('<tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == "user" or message.role == "system" %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning) %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {%- if message.meta is defined %}{{- '\\n' + message.meta | tojson }}{%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

GEMMA3 = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- set role = "model" if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {{ message['content'] | trim }}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\\n' }}
{%- endif -%}"""

PHI = """{% for message in messages %}{% if message['role'] == 'system' and message['content'] %}{{'<|system|>\\n' + message['content'] + '<|end|>\\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\\n' + message['content'] + '<|end|>\\n'}}{% elif message['role'] == 'assistant' %}{{'<|assistant|>\\n' + message['content'] + '<|end|>\\n'}}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"""

MISTRAL = """{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message["role"] == "user" %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\\n\\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- else %}
        {{- " " + message["content"]|trim + eos_token }}
    {%- endif %}
{%- endfor %}"""

FAMILIES = {
    # name: (template, special tokens, bos, eos, end-of-turn)
    "qwen3": (QWEN3, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>", "<|im_end|>"),
    "gemma3": (GEMMA3, ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], "<bos>", "<eos>", "<end_of_turn>"),
    "phi": (PHI, ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|endoftext|>"], None, "<|endoftext|>", "<|end|>"),
    "mistral": (MISTRAL, ["<s>", "</s>", "[INST]", "[/INST]"], "<s>", "</s>", "</s>"),
}

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
    [{"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": "Once upon a time, a fox."},
     {"role": "user", "content": "Longer, with ünïcode & <tags>."}, {"role": "assistant", "content": "The fox ran.\nThe end."}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
     {"role": "user", "content": "c"}],
    [{"role": "system", "content": "Think first."}, {"role": "user", "content": "Why?"},
     {"role": "assistant", "content": "<think>\nBecause.\n</think>\n\nIt is so."}, {"role": "user", "content": "And?"},
     {"role": "assistant", "content": "<think>More.</think>Yes."}],
]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def tok_dir(request, tmp_path_factory):
    from tokenizers import Tokenizer as HFTokenizer

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPILLPACK_HOME", str(tmp_path_factory.mktemp("home")))
        src = ensure_tiny()
    template, specials, bos, eos, _ = FAMILIES[request.param]
    d = tmp_path_factory.mktemp(request.param)
    tok = HFTokenizer.from_file(str(src / "tokenizer.json"))
    tok.add_special_tokens(specials)
    tok.save(str(d / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in specials}
    (d / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": True} for t, i in ids.items()},
        "bos_token": bos, "eos_token": eos, "chat_template": template, "clean_up_tokenization_spaces": False,
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 2048,
    }))
    shutil.copy(src / "config.json", d / "config.json")
    return request.param, d


def hf_render(d, msgs, gen, **kwargs):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(d)).apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen, **kwargs)


@pytest.mark.parametrize("gen", [False, True])
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
def test_rendering_matches_transformers(tok_dir, conv, gen):
    name, d = tok_dir
    ours = Tokenizer.from_dir(d)
    msgs = CONVERSATIONS[conv]
    # Thinking is off unless asked for: what transformers renders with enable_thinking=False...
    assert ours.apply_chat_template(msgs, add_generation_prompt=gen) == hf_render(d, msgs, gen, enable_thinking=False)
    # ...and with it on, what transformers renders by default.
    assert ours.apply_chat_template(msgs, add_generation_prompt=gen, enable_thinking=True) == hf_render(d, msgs, gen)


def test_qwen3_thinking_switch_changes_only_the_generation_prompt(tok_dir):
    name, d = tok_dir
    if name != "qwen3":
        pytest.skip("Qwen3's feature")
    ours = Tokenizer.from_dir(d)
    off = ours.apply_chat_template(CONVERSATIONS[0], add_generation_prompt=True)
    on = ours.apply_chat_template(CONVERSATIONS[0], add_generation_prompt=True, enable_thinking=True)
    assert off == on + "<think>\n\n</think>\n\n"
    # Earlier turns' reasoning is dropped (the last query is the 2nd user message), the last turn's kept.
    full = ours.apply_chat_template(CONVERSATIONS[4])
    assert "Because." not in full and "It is so." in full and "<think>\nMore.\n</think>\n\nYes." in full


def test_roles_a_template_refuses_are_one_error(tok_dir):
    name, d = tok_dir
    if name not in ("gemma3", "mistral"):
        pytest.skip("only Gemma's and Mistral's templates refuse roles")
    ours = Tokenizer.from_dir(d)
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(SpillpackError) as e:
        ours.apply_chat_template(bad)
    assert "roles must alternate user/assistant" in e.value.line() and "\n" not in e.value.line()
    import jinja2

    with pytest.raises(jinja2.exceptions.TemplateError, match="roles must alternate"):
        hf_render(d, bad, False)


@pytest.mark.parametrize("conv", [1, 2, 4])
def test_mask_is_each_answer_and_its_end_of_turn(tok_dir, conv):
    """Prefix-stable or not (Qwen3 drops earlier thinking, Mistral moves the system prompt to the
    last user turn, Phi ends a finished conversation with eos), the trained tokens are each
    assistant answer and the end-of-turn token after it; Qwen3's reasoning is not trained."""
    name, d = tok_dir
    ours = Tokenizer.from_dir(d)
    msgs = CONVERSATIONS[conv]
    ids, mask = ours.encode_chat(msgs)
    assert ids == ours.encode(ours.apply_chat_template(msgs)) and len(mask) == len(ids)
    eot = FAMILIES[name][4]
    # Only Qwen3's template separates reasoning from the answer; the others render content as given.
    answers = [m["content"].split("</think>")[-1] if name == "qwen3" else m["content"] for m in msgs if m["role"] == "assistant"]
    trained = ours.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)
    # Whitespace the template puts between an answer and its end-of-turn token is trained with it.
    squash = lambda text: "".join(text.split())  # noqa: E731
    assert squash(trained) == squash("".join(a + eot for a in answers))
    eot_id = ours.token_to_id(eot)
    runs_end = [ids[j] for j in range(len(ids)) if mask[j] and (j + 1 == len(ids) or not mask[j + 1])]
    assert len(runs_end) == len(answers) and all(t == eot_id for t in runs_end)


def test_a_run_row_asks_for_thinking(tok_dir):
    """`run` renders rows with thinking off; a row turns it on with chat_template_kwargs, as
    vLLM's OpenAI server takes it."""
    from runtime.data.rows import encode_rows, parse_rows

    name, d = tok_dir
    if name != "qwen3":
        pytest.skip("Qwen3's feature")
    ours = Tokenizer.from_dir(d)
    lines = [{"custom_id": "off", "body": {"messages": CONVERSATIONS[0]}},
             {"custom_id": "on", "body": {"messages": CONVERSATIONS[0], "chat_template_kwargs": {"enable_thinking": True}}},
             {"custom_id": "bad", "body": {"messages": CONVERSATIONS[0], "chat_template_kwargs": "yes"}}]
    rows = parse_rows("".join(json.dumps(x) + "\n" for x in lines).encode(), "rows.jsonl", 8, 0.0, 1.0, 0)
    encode_rows(rows, ours, 2048)
    off, on, bad = rows
    assert ours.decode(off.prompt_ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert ours.decode(on.prompt_ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    assert bad.error == "chat_template_kwargs must be a JSON object, not 'yes'"
