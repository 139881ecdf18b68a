"""A job's input data checked as the job will read it, before any work: `spillpack pack` runs
this so a bundle never carries a job its runtime would refuse. The checks are the jobs' own
parsers (the same lines, the same messages), without a model or tokenizer."""

from runtime.data.rows import parse_rows
from runtime.data.jsonl import read_bytes
from runtime.data.train import train_conversations
from runtime.state.store import local_file

ROW_INPUTS = {"run": "input", "eval": "evals", "distill": "prompts"}


def check_inputs(inv) -> None:
    values = {**inv.arguments, **inv.options}
    if inv.command == "tune":
        _train(values["data"])
    elif inv.command in ROW_INPUTS:
        _rows(inv.command, values[ROW_INPUTS[inv.command]], values)
    elif inv.command == "build":
        folder = str(values["folder"]).rstrip("/")
        _rows("eval", f"{folder}/evals.jsonl", values, missing_ok=True)
        _rows("distill", f"{folder}/prompts.jsonl", values, missing_ok=True)
        _train(f"{folder}/train.jsonl", missing_ok=True)


def _readable(uri: str, missing_ok: bool, what: str) -> bytes | None:
    if local_file(uri) is None:
        return None  # s3:// is read on the target, with its credentials
    return read_bytes(uri, what, missing_ok=missing_ok)


def _train(uri: str, missing_ok: bool = False) -> None:
    raw = _readable(uri, missing_ok, "training data")
    if raw is not None:
        train_conversations(raw, uri)


def _rows(command: str, uri: str, values: dict, missing_ok: bool = False) -> None:
    raw = _readable(uri, missing_ok, "input")
    if raw is None:
        return
    rows = parse_rows(raw, uri, values["max_tokens"], values.get("temperature", 0.0), values.get("top_p", 1.0), values["seed"])
    if command == "eval":
        from runtime.jobs.eval import expected_check

        expected_check(values["metric"], values.get("field"))(rows, uri)
