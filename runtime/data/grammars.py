"""A row's `response_format` as a grammar for llguidance, the constrained-decoding library.

OpenAI's two structured forms: {"type": "json_object"} (any JSON object) and
{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}. Either becomes an
llguidance grammar (its JSON-schema compiler), checked when the rows are read: a schema it
cannot compile is that row's error, never a failure of the job. The generator masks each
step's logits to the tokens the grammar allows (runtime/engines/generation.py).

Whitespace between JSON tokens is not free: a model that likes spaces could otherwise spend
all its tokens on them. Answers are compact JSON with ", " and ": " separators.

llguidance is imported only when a row asks for structured output: plain jobs never load it.
"""

from __future__ import annotations

import re

import orjson

# The schema's shape of answer: no whitespace beyond the separators.
COMPILE_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_SCHEMA_BYTES = 200_000
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class FormatError(ValueError):
    pass


def grammar_for(response_format) -> str | None:
    """The llguidance grammar text for a row's response_format (None for plain text), or
    FormatError saying what is wrong with it."""
    if not isinstance(response_format, dict):
        raise FormatError(f"response_format must be a JSON object, not {response_format!r}"[:200])
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        schema = {"type": "object"}
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise FormatError("response_format.json_schema must be a JSON object with \"name\" and \"schema\"")
        name = spec.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise FormatError("response_format.json_schema.name must be 1-64 letters, digits, '_' or '-'")
        if "strict" in spec and spec["strict"] is not None and not isinstance(spec["strict"], bool):
            raise FormatError("response_format.json_schema.strict must be true or false")
        schema = spec.get("schema", {})
        if not isinstance(schema, dict):
            raise FormatError(f"response_format.json_schema.schema must be a JSON Schema object, not {type(schema).__name__}")
        if len(orjson.dumps(schema)) > MAX_SCHEMA_BYTES:
            raise FormatError(f"response_format.json_schema.schema is over {MAX_SCHEMA_BYTES} bytes")
    else:
        raise FormatError(f"response_format.type must be \"text\", \"json_object\" or \"json_schema\", not {kind!r}"[:200])
    import llguidance

    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(orjson.dumps(schema).decode(), overrides=COMPILE_OPTIONS)
    except (ValueError, TypeError) as e:
        raise FormatError(f"response_format schema is not JSON Schema ({e})"[:300])
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem:
        first = " ".join(problem.split())
        raise FormatError(f"response_format schema cannot be compiled: {first}"[:300])
    return grammar
