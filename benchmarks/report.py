"""docs/benchmarks.md from the measurements `make bench` keeps: one JSON file per machine under
benchmarks/results/, one table per file. A row is keyed by its command, so a rerun on the same
CPU replaces that CPU's rows and leaves the other machines' tables as they were.

A row: {"command", "dtype", "threads", "ours", "peer", "peer_name", "ratio", "load"}; `ours` and
`peer` are figures with their units, `ratio` ours over the peer on the headline figure, a speed
(above 1: spillpack is faster), `load` the load average around the measurement.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
DOC = HERE.parent / "docs" / "benchmarks.md"
FLAGS = ("amx_bf16", "avx512_bf16", "avx512f", "avx2")  # what decides a CPU's dtype and kernels

METHOD = """\
## Method

- Both sides run one after the other in one `make bench`, on the same model, rows and token
  limits, each in its own process where memory is compared (peak RSS from `getrusage`).
  Alternating rounds (each side's median) where a command says so: a shared host's speed
  drifts within minutes, and alternation puts the drift on both sides.
- `bench_tune.py`: `spillpack tune` against a plain transformers + PEFT loop
  (`model(input_ids, labels=...)`, `loss.backward()`, AdamW) on the same token sequences in the
  same batches, rank 16 on q/k/v/o, first step excluded.
- `bench_run.py`: `spillpack run`'s continuous batching against transformers' `generate` on
  static left-padded batches in input order, greedy; every row is checked token-identical.
  `--stop mixed` lets rows end at different lengths, as a batch job's do; `length` forces all to
  the token limit.
- `bench_shared.py`: spillpack's default thread count against the best fixed setting, with one
  CPU held by a busy loop (a node shared with another job).
- `bench_llamacpp.py`: `spillpack run` against llama-cpp-python (built from its sdist on first
  use) on the same GGUF file and the same prompt token ids, same thread count.
- `bench_adapters.py`: `run` with four LoRA adapters in one batch (`--adapter NAME=SRC`, rows
  spread round-robin) against the same rows on one adapter in the same process, and one `run`
  job end to end (process start to exit) against a job per adapter run one after the other;
  `--baseline` repeats the one-adapter pass on another checkout's code.
- `bench_qlora.py`: `spillpack tune` on SmolLM2-135M's Q4_1 GGUF with its frozen base kept in
  the quantized blocks against the same tune with the base dequantized at load
  (`SPILLPACK_QUANT_GEMM`), each its own process, alternating; both write the same adapter.
- `bench_stream.py`: `spillpack run` with its weights streamed from the GGUF's map
  (`SPILLPACK_WEIGHTS=stream`) against the same run with them resident, alternating; the peak RSS
  of a streamed run counts the mapped pages it touched (unlimited, every one of them).
- Other benchmarks in `benchmarks/` (engines, pack, S3, shards, memory, validation, grammar,
  sharded tune) print their own tables; their docstrings say how.
- Threads are each side's `--threads` (or its default where the command says so). A load average
  above the CPU count means other processes shared the cores: read such rows as ratios only.
"""


def machine() -> dict:
    from runtime.base.place import cpu_model

    try:
        text = Path("/proc/cpuinfo").read_text()
        flags = set(next(l for l in text.splitlines() if l.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        flags = set()
    return {"cpu": cpu_model(), "cpus": os.cpu_count(), "flags": [f for f in FLAGS if f in flags]}


def slug(m: dict) -> str:
    return re.sub(r"[^a-z0-9]+", "-", f"{m['cpu']} {m['cpus']}cpu {' '.join(m['flags'])}".lower()).strip("-")


def record(rows: list[dict], m: dict | None = None, results: Path = RESULTS) -> Path:
    """Merge these rows into this machine's file (a row with the same command is replaced)."""
    m = m or machine()
    path = results / f"{slug(m)}.json"
    old = json.loads(path.read_text()) if path.exists() else {**m, "rows": []}
    merged = {r["command"]: r for r in old["rows"]}  # a rerun keeps its row's place in the table
    merged.update((r["command"], r) for r in rows)
    results.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**m, "rows": list(merged.values())}, indent=1) + "\n")
    return path


def cell(v) -> str:
    return "" if v is None else str(v).replace("|", "\\|")


def table(data: dict) -> list[str]:
    flags = ", ".join(f.upper().replace("_", "-") for f in data["flags"]) or "none of " + ", ".join(FLAGS)
    out = [f"## {data['cpu']}, {data['cpus']} CPUs ({flags})", "",
           "| command | dtype | threads | spillpack | peer | ratio | load |", "|---|---|---:|---|---|---:|---|"]
    for r in data["rows"]:
        peer = f"{r['peer_name']}: {r['peer']}" if r.get("peer_name") else r.get("peer")
        ratio = f"{r['ratio']:.2f}x" if isinstance(r.get("ratio"), (int, float)) else cell(r.get("ratio"))
        out.append(f"| `{cell(r['command'])}` | {cell(r.get('dtype'))} | {cell(r.get('threads'))} | {cell(r.get('ours'))} | "
                   f"{cell(peer)} | {ratio} | {cell(r.get('load'))} |")
    return out


def write(results: Path = RESULTS, doc: Path = DOC) -> str:
    parts = ["# Benchmarks", "",
             "Written by `make bench` (`benchmarks/run_all.py`): one table per machine it ran on; a rerun on the",
             "same CPU replaces that CPU's rows. The ratio is spillpack's speed over the peer's (above 1:",
             "spillpack is faster); memory figures are in the cells. The method is at the end.", ""]
    for path in sorted(results.glob("*.json")):
        parts += [*table(json.loads(path.read_text())), ""]
    text = "\n".join(parts) + "\n" + METHOD
    doc.write_text(text)
    return text
