"""A model's tokenizer and chat template, read from its HF directory without transformers.

The chat template is rendered the way transformers' `apply_chat_template(tokenize=False)`
does (same sandboxed Jinja environment, filters and globals), so prompts and training
sequences match what the model was trained on.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from functools import cached_property
from pathlib import Path

from runtime.base.errors import SpillpackError
from runtime.models.gguf import is_gguf_file

# Variables every template sees unless a caller overrides them (transformers passes a call's
# kwargs the same way): thinking off, for training data and for `run` rows that do not ask.
TEMPLATE_DEFAULTS = {"enable_thinking": False}

# End-of-turn tokens of the chat formats we know; one found in the template also stops generation.
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")


def _read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise SpillpackError(f"{path} is not valid JSON ({e})", f"re-download the model into {path.parent}")


def _token_text(value) -> str | None:
    # tokenizer_config writes special tokens as a string or as an AddedToken dict.
    if isinstance(value, dict):
        return value.get("content")
    return value


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else [int(v) for v in value]


# A render's bounds (runtime.models.template_sandbox): items all its range() calls may yield
# together, characters it may build beyond the conversation's own, and seconds. A real template
# renders a conversation in a few kilobytes and a millisecond, with no range() to speak of.
RANGE_BUDGET = 100_000
MAX_BYTES = 1 << 20
MAX_SECONDS = 5.0
MAX_JSON_INDENT = 8  # tojson(indent=...): real templates indent by 2 or 4


def _bound(name: str, default: float, kind=int) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        value = 0
    if not value > 0:
        raise SpillpackError(f"{name}={raw!r} is not a positive {'whole ' if kind is int else ''}number",
                             f"unset {name}, or e.g. {name}={kind(default * 4)}")
    return value


def compile_template(source: str):
    """The Jinja environment of transformers' chat templates: sandboxed, trim/lstrip blocks, and
    bounded work (runtime.models.template_sandbox)."""
    import jinja2
    import jinja2.ext

    from runtime.models.template_sandbox import BoundedSandbox

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters; transformers' (and so the models') does not.
        if isinstance(indent, int) and indent > MAX_JSON_INDENT or isinstance(indent, str) and len(indent) > MAX_JSON_INDENT:
            raise jinja2.exceptions.SecurityError(f"tojson is asked to indent by {indent!r}; at most {MAX_JSON_INDENT}")
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    env = BoundedSandbox(RANGE_BUDGET, _bound("SPILLPACK_TEMPLATE_MAX_BYTES", MAX_BYTES),
                         _bound("SPILLPACK_TEMPLATE_MAX_SECONDS", MAX_SECONDS, float),
                         trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.finish_setup()
    return env.from_string(source)


def is_trained(message: dict) -> bool:
    """Whether a message's tokens are trained: an assistant turn, unless OpenAI's fine-tuning
    format gives it "weight": 0 (1, or no weight, trains it)."""
    return message.get("role") == "assistant" and message.get("weight", 1) != 0



class Tokenizer:
    def __init__(self, tokenizer, tokenizer_config: dict, config: dict, generation_config: dict, chat_template: str | None, path: Path):
        self._tok = tokenizer
        self.path = path
        self.tokenizer_config = tokenizer_config
        self.chat_template = chat_template
        self.special_tokens = {
            name: text
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
            if (text := _token_text(tokenizer_config.get(name))) is not None
        }
        eos = set(_ids(generation_config.get("eos_token_id"))) | set(_ids(config.get("eos_token_id")))
        for text in [self.special_tokens.get("eos_token")] + [t for t in END_OF_TURN if chat_template and t in chat_template]:
            if text is not None and (i := tokenizer.token_to_id(text)) is not None:
                eos.add(i)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        pad = self.special_tokens.get("pad_token")
        pad_id = tokenizer.token_to_id(pad) if pad else None
        for fallback in (config.get("pad_token_id"), generation_config.get("pad_token_id")):
            if pad_id is None and isinstance(fallback, int):
                pad_id = fallback
        # No pad token at all (Llama 3 base): pad with an eos; pads are masked out anyway.
        self.pad_token_id: int | None = pad_id if pad_id is not None else (min(eos) if eos else None)

    @classmethod
    def from_dir(cls, path) -> "Tokenizer":
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        if is_gguf_file(path):  # a .gguf, or an Ollama blob
            return cls.from_gguf(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.exists():
            raise SpillpackError(f"no tokenizer.json in {path}", f"copy the tokenizer files of the model into {path}")
        try:
            tok = HFTokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # the Rust side raises a bare Exception
            raise SpillpackError(f"{tokenizer_file} cannot be read ({e})", f"re-download the model into {path}")
        tokenizer_config = _read_json(path / "tokenizer_config.json")
        template = tokenizer_config.get("chat_template")
        if isinstance(template, list):  # named templates: transformers uses "default"
            template = {t.get("name"): t.get("template") for t in template}.get("default")
        # transformers >= 4.43 saves the template to its own file, and prefers that file.
        if (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        return cls(tok, tokenizer_config, _read_json(path / "config.json"), _read_json(path / "generation_config.json"), template, path)

    @classmethod
    def from_gguf(cls, path) -> "Tokenizer":
        """The tokenizer and chat template a GGUF's metadata describes (runtime.models.gguf.tokenizer)."""
        from runtime.models.gguf.model import tokenizer_parts

        tok, tokenizer_config, config = tokenizer_parts(path)
        return cls(tok, tokenizer_config, config, {}, tokenizer_config.get("chat_template"), Path(path))

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def backend(self):
        """The `tokenizers` Tokenizer itself (its vocabulary, for logprobs' bytes and grammars)."""
        return self._tok

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, adding no BOS/EOS (chat templates write those themselves)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @cached_property
    def _template(self):
        if not self.chat_template:
            raise SpillpackError(
                f"the tokenizer in {self.path} has no chat template",
                "an instruct/chat model, or plain-text prompts instead of messages",
            )
        return compile_template(self.chat_template)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False, **kwargs) -> str:
        """The conversation as transformers' apply_chat_template(tokenize=False) renders it.

        `kwargs` reach the template as variables, as transformers passes them; thinking is off
        unless asked for (enable_thinking=True): Qwen3's template then writes an empty think block
        into the generation prompt, so `run` answers and training targets carry no reasoning.
        """
        import jinja2

        variables = {**TEMPLATE_DEFAULTS, **kwargs}
        try:
            return self._template.environment.render_bounded(
                self._template, messages=messages, tools=None, documents=None, add_generation_prompt=add_generation_prompt,
                **self.special_tokens, **variables
            )
        except jinja2.exceptions.SecurityError as e:
            raise SpillpackError(f"the chat template of {self.path} refused the conversation: {e}",
                                 "a model whose chat template you trust; docs/models.md#chat-templates says what a template may do "
                                 "and how to raise its bounds") from None
        except (jinja2.exceptions.TemplateError, OverflowError, RecursionError, MemoryError) as e:
            raise SpillpackError(f"the chat template of {self.path} refused the conversation: {e}", "check the roles and order of the messages")

    def encode_prompt(self, messages: list[dict], **kwargs) -> list[int]:
        """Token ids of a conversation followed by the assistant header, ready to generate from."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt=True, **kwargs))

    def encode_chat(self, messages: list[dict], **kwargs) -> tuple[list[int], list[int]]:
        """Token ids of a whole conversation and a loss mask over them.

        The mask is 1 on each assistant turn's content and its end-of-turn token, 0 on
        everything the template adds around it (system prompt, headers, user turns) and on an
        assistant turn with OpenAI's "weight": 0.
        The rendering is cut after each message; what each cut adds is tokenized on its
        own, so every token is known to come from one message.

        A template that rewrites earlier turns as the conversation grows is not prefix-stable
        (Qwen3 drops the think block of assistant turns before the last user message; Mistral
        moves the system prompt to the last user turn). Then the whole conversation is
        rendered once, as the model sees it, each assistant message's content is found in it
        in order, and the mask covers the tokens of that content and the end-of-turn token
        right after it.
        """
        pieces: list[tuple[str, bool]] = []  # (text, is assistant body) in rendering order
        done = ""
        for i, message in enumerate(messages):
            if message.get("role") == "assistant":
                header = self.apply_chat_template(messages[:i], add_generation_prompt=True, **kwargs) if i else ""
                if not header.startswith(done):
                    return self._mask_by_content(messages, kwargs)
                pieces.append((header[len(done):], False))
                done = header
            full = self.apply_chat_template(messages[: i + 1], **kwargs)
            if not full.startswith(done):
                return self._mask_by_content(messages, kwargs)
            pieces.append((full[len(done):], is_trained(message)))
            done = full
        ids, mask = [], []
        for text, trained in pieces:
            piece_ids = self.encode(text)
            ids += piece_ids
            mask += self._body_mask(piece_ids) if trained else [0] * len(piece_ids)
        if ids != self.encode(done):
            return self._mask_by_offsets(done, pieces)
        return ids, mask

    def _mask_by_content(self, messages: list[dict], kwargs: dict) -> tuple[list[int], list[int]]:
        text = self.apply_chat_template(messages, **kwargs)
        spans, pos = [], 0
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            content = str(message.get("content") or "").strip()
            # Qwen3 renders an earlier turn's "<think>...</think>answer" as the answer alone, and the
            # last turn's reasoning in its own think block: the answer is what is found (and trained).
            start = -1
            for candidate in dict.fromkeys([content, content.split("</think>")[-1].strip()]):
                if candidate and (start := text.find(candidate, pos)) >= 0:
                    content = candidate
                    break
            if start < 0:
                raise SpillpackError(
                    f"the chat template of {self.path} rewrites earlier turns and message {i}'s content is not in its "
                    "rendering, so its tokens cannot be masked",
                    "a model whose chat template renders assistant content as given (Qwen2.5, Qwen3, Llama 3, Gemma 3)",
                )
            end = start + len(content)
            while end < len(text) and text[end].isspace():  # the content's own trailing whitespace, or glue
                end += 1  # before its end-of-turn token (trained either way in the prefix-stable path)
            if is_trained(message):  # found either way, so the next turn is looked for after it
                spans.append((start, end))
            pos = end
        enc = self._tok.encode(text, add_special_tokens=False)
        mask = [1 if any(s < b and e > a for a, b in spans) else 0 for s, e in enc.offsets]
        for j in range(1, len(mask)):  # the end-of-turn token right after a trained content
            if mask[j - 1] and not mask[j] and enc.ids[j] in self.eos_token_ids:
                mask[j] = 1
        return enc.ids, mask

    def _body_mask(self, ids: list[int]) -> list[int]:
        # Up to and including the last end-of-turn token: the model must learn to stop.
        # What follows it (Qwen's "\n") is template glue and is not trained.
        last = max((j for j, t in enumerate(ids) if t in self.eos_token_ids), default=len(ids) - 1)
        return [1 if j <= last else 0 for j in range(len(ids))]

    def _mask_by_offsets(self, text: str, pieces) -> tuple[list[int], list[int]]:
        # Tokens merged across a cut: tokenize the whole text and mask by character spans.
        enc = self._tok.encode(text, add_special_tokens=False)
        spans, pos = [], 0
        for piece, trained in pieces:
            if trained:
                spans.append((pos, pos + len(piece)))
            pos += len(piece)
        mask = [1 if any(a <= start < b for a, b in spans) else 0 for start, _ in enc.offsets]
        return enc.ids, mask
