"""docs/benchmarks.md as `make bench` writes it (benchmarks/report.py): one table per machine, a
rerun on the same CPU replacing that CPU's rows and leaving the other machines' tables alone."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import report  # noqa: E402

ZEN4 = {"cpu": "AMD EPYC", "cpus": 2, "flags": ["avx512_bf16", "avx512f", "avx2"]}
XEON = {"cpu": "Intel(R) Xeon(R) Platinum 8488C", "cpus": 2, "flags": ["amx_bf16", "avx512_bf16", "avx512f", "avx2"]}


def row(command, ratio, ours="10 tokens/s"):
    return {"command": command, "dtype": "float32", "threads": 2, "ours": ours, "peer": "5 tokens/s",
            "peer_name": "llama.cpp", "ratio": ratio, "load": "0.1 -> 0.2"}


def test_a_rerun_replaces_its_cpus_rows_only(tmp_path):
    res, doc = tmp_path / "results", tmp_path / "benchmarks.md"
    report.record([row("bench_run.py --model tiny", 2.0), row("bench_tune.py --shape tiny", 1.5)], ZEN4, res)
    report.record([row("bench_run.py --model tiny", 3.0)], XEON, res)
    report.record([row("bench_run.py --model tiny", 2.5, ours="12 tokens/s")], ZEN4, res)
    text = report.write(res, doc)
    assert doc.read_text() == text
    tables = text.split("\n## ")[1:-1]  # the machines' tables, then the method
    assert [t.splitlines()[0] for t in tables] == [
        "AMD EPYC, 2 CPUs (AVX512-BF16, AVX512F, AVX2)", "Intel(R) Xeon(R) Platinum 8488C, 2 CPUs (AMX-BF16, AVX512-BF16, AVX512F, AVX2)"]
    zen4 = [l for l in tables[0].splitlines() if l.startswith("| `")]
    assert zen4 == ["| `bench_run.py --model tiny` | float32 | 2 | 12 tokens/s | llama.cpp: 5 tokens/s | 2.50x | 0.1 -> 0.2 |",
                    "| `bench_tune.py --shape tiny` | float32 | 2 | 10 tokens/s | llama.cpp: 5 tokens/s | 1.50x | 0.1 -> 0.2 |"]
    assert "| 3.00x |" in tables[1] and "2.50x" not in tables[1]
    assert text.index("\n## Method\n") > text.index("| 3.00x |")  # the method after every table


def test_a_pipe_in_a_figure_stays_in_its_cell(tmp_path):
    report.record([row("bench_x.py --stop 'a|b'", 1.0)], ZEN4, tmp_path)
    line = next(l for l in report.write(tmp_path, tmp_path / "b.md").splitlines() if "bench_x" in l)
    assert line.count(" | ") == 6 and "a\\|b" in line


def test_the_docs_page_is_the_generators_output():
    """docs/benchmarks.md is written from benchmarks/results/, never by hand."""
    results = REPO / "benchmarks" / "results"
    assert (REPO / "docs" / "benchmarks.md").read_text() == report.write(results, Path("/dev/null"))
