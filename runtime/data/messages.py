"""Chat messages as both tune and the row jobs take them: OpenAI's shape, checked once.

A message is {"role", "content"} with a role a chat template knows, and content a string
or, as OpenAI's API also writes it, a list of text parts ({"type": "text", "text": ...}),
which are joined into one string; "developer" (OpenAI's newer name for the system role) is
given to the template as "system", the role templates know. Anything else (an unknown role, null content, an image
part) is named in one line instead of reaching the template.
"""

from __future__ import annotations

ROLES = ("system", "developer", "user", "assistant", "tool")


def normalize(messages) -> tuple[list[dict] | None, str | None]:
    """(messages with string content, None), or (None, what is wrong with them)."""
    if not isinstance(messages, list) or not messages:
        return None, "\"messages\" must be a non-empty list of {role, content}"
    out = []
    for i, m in enumerate(messages, 1):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return None, f"message {i} must be an object with a \"role\""
        if m["role"] not in ROLES:
            return None, f"message {i} has an unknown role {m['role']!r} (one of {', '.join(ROLES)})"
        content, problem = _text(m.get("content"))
        if problem:
            return None, f"message {i} ({m['role']}): {problem}"
        out.append({**m, "role": "system" if m["role"] == "developer" else m["role"], "content": content})
    return out, None


def _text(content) -> tuple[str | None, str | None]:
    if isinstance(content, str):
        return content, None
    if content is None:
        return None, "\"content\" is null (a string or a list of text parts is needed)"
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                return None, f"content part of type {kind!r} is not supported (only {{\"type\": \"text\", \"text\": ...}} parts)"
            texts.append(part["text"])
        return "\n".join(texts), None
    return None, f"\"content\" must be a string or a list of text parts, not {type(content).__name__}"


def weight_problem(messages: list[dict]) -> str | None:
    """What is wrong with the messages' "weight" keys (OpenAI's format: 0 or 1, on assistant messages)."""
    for i, m in enumerate(messages, 1):
        if "weight" not in m:
            continue
        if m["weight"] not in (0, 1) or isinstance(m["weight"], bool):
            return f"message {i} has \"weight\": {m['weight']!r} (OpenAI's format takes 0 or 1)"
        if m["role"] != "assistant":
            return f"message {i} ({m['role']}) has a \"weight\", which only assistant messages take"
    return None
