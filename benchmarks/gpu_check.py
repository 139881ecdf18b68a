"""torch-cuda's acceptance test on a CUDA machine: every promise checked, any failure exits 1.

    bash benchmarks/gpu_check.sh                           # on the GPU machine, from the repo root
    python benchmarks/gpu_check.py --rehearse-on-cpu       # this script's own logic, on a CPU

Checks, each PASS or FAIL with its figures (a crash or a timeout is a FAIL that says which):
  doctor      `--engine auto` chose torch-cuda; the matmul rate is measured in the engine's dtype
  logits      float32 on the device within 1e-4 of the CPU (tied and untied heads); the engine's
              own base (bfloat16 or float16) within 2x the rounding of that dtype on the CPU
              (|device - CPU same dtype| <= 2 max|CPU that dtype - CPU float32| + 1e-3); no NaN
  tune        30 steps (grad-accum 2, dropout 0.1, --merge) on torch-cuda: every event says
              torch-cuda, every loss finite and within 5% of the same job on torch-cpu
  resume      the same tune SIGTERMed mid-run and run again ends bit-identical (adapter and every
              loss) to the uninterrupted run on this GPU: the determinism promise
  merge       merged weights equal the checkpoint's float32 tensors + scale B A (1e-6), and the
              tensors no adapter touches are the checkpoint's bytes
  generate    greedy and sampled rows, with and without an adapter, in float32 on the device:
              token-identical to the CPU; the every-slot decode path identical to the
              running-rows path; the engine's own dtype: every row finishes
  figures     tune tokens/s and peak reserved memory on the Qwen2.5-0.5B shape (random
              weights), generation tokens/s: printed for README, not asserted

Under 5 minutes on one GPU (the 0.5B figures take most of it). The rehearsal runs every step
with the CPU standing in for the device (torch-cpu for torch-cuda, a bfloat16 base for the
engine's): it proves the script, not the GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from runtime.engines import OptimSpec  # noqa: E402

from runtime.engines.registry import get_engine  # noqa: E402
from runtime.engines.torch.decode import TorchDecoder  # noqa: E402
from runtime.engines.torch.models import load_checkpoint  # noqa: E402
from runtime.engines.generation import Generator, Request  # noqa: E402
from runtime.models.lora import LoraSpec, init_tensors, load_adapter  # noqa: E402
from runtime.models.ref import resolve_model  # noqa: E402
from runtime.models.tiny import ensure_tiny  # noqa: E402
from runtime.models.tokenizer import Tokenizer  # noqa: E402

DATA = REPO / "examples/data/train.jsonl"
TUNE = ["--steps", "30", "--batch", "4", "--grad-accum", "2", "--lr", "2e-3", "--warmup", "5", "--dropout", "0.1",
        "--targets", "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", "--rank", "8", "--ckpt-every", "4"]
QWEN05 = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864,
              vocab_size=151936, tie_word_embeddings=True, rope_theta=1000000.0)


class Check:
    def __init__(self, rehearse: bool, work: Path):
        self.rehearse, self.work = rehearse, work
        self.engine_name = "torch-cpu" if rehearse else "torch-cuda"
        self.device = "cpu" if rehearse else "cuda"
        self.low = torch.bfloat16 if rehearse else None  # the engine's own base dtype (None: its policy)
        self.slow = 20 if rehearse else 1  # a shared CPU is far slower than the GPU the timeouts are sized for
        self.failures: list[str] = []
        self.figures: dict = {}

    # -- reporting -------------------------------------------------------------------------

    def run(self, name: str, fn) -> None:
        t0 = time.monotonic()
        try:
            detail = fn()
            print(f"PASS {name:<9} {time.monotonic() - t0:6.1f}s  {detail}", flush=True)
        except AssertionError as e:
            self.fail(name, f"{e}", t0)
        except subprocess.TimeoutExpired as e:
            self.fail(name, f"timed out after {e.timeout:.0f}s: {' '.join(map(str, e.cmd[:6]))}", t0)
        except Exception as e:  # a crash is a failure of the check, reported as one, not a traceback at the end
            self.fail(name, f"crashed: {type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}", t0)

    def fail(self, name: str, why: str, t0: float) -> None:
        self.failures.append(name)
        print(f"FAIL {name:<9} {time.monotonic() - t0:6.1f}s  {why}", flush=True)

    # -- helpers ---------------------------------------------------------------------------

    def cli(self, args, timeout=150, check=True) -> tuple[int, list[dict], str]:
        env = {**os.environ, "SPILLPACK_HEADLESS": "1", "PYTHONPATH": str(REPO)}
        r = subprocess.run([sys.executable, "-m", "spillpack", *args], capture_output=True, text=True, env=env,
                           timeout=timeout * self.slow, cwd=REPO)
        events = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
        if check:
            assert r.returncode == 0, f"spillpack {args[0]} exited {r.returncode}: {r.stderr.strip()[-400:]}"
        return r.returncode, events, r.stderr

    def engine(self, base_dtype=None):
        if self.rehearse:
            return get_engine("torch-cpu", base_dtype=base_dtype or self.low)
        return get_engine("torch-cuda", base_dtype=base_dtype)

    # -- the checks ------------------------------------------------------------------------

    def doctor(self):
        _, events, _ = self.cli(["doctor"], timeout=120)
        r = events[0]
        chosen = r["engine"]
        assert chosen == self.engine_name, f"--engine auto chose {chosen}: {r['engine_reason']}"
        e = r["engines"][self.engine_name]
        want = "float32" if self.rehearse else self.engine().precision.name
        assert e["matmul_dtype"] == want, f"doctor measured {e['matmul_dtype']}, the engine computes in {want}"
        assert e["matmul_gflops"] > 0
        self.figures["doctor"] = e
        return f"{chosen} ({e['detail']}): {e['matmul_gflops']} GFLOP/s {e['matmul_dtype']} matmul, {e['mem_gbps']} GB/s"

    def logits(self):
        out = []
        for md in (resolve_model(str(ensure_tiny())), self.untied):
            ids = torch.randint(0, md.config["vocab_size"], (4, 64), generator=torch.Generator().manual_seed(0))
            with torch.no_grad():
                ref = get_engine("torch-cpu").load_model(md)(ids)
                f32 = self.engine(torch.float32).load_model(md)(ids.to(self.device)).float().cpu()
                eng = self.engine()
                low = eng.load_model(md)(ids.to(self.device)).float().cpu()
                cpu_low = get_engine("torch-cpu", base_dtype=eng.base_dtype).load_model(md)(ids).float()
            d32, dlow, rounding = (f32 - ref).abs().max().item(), (low - cpu_low).abs().max().item(), (cpu_low - ref).abs().max().item()
            assert torch.isfinite(low).all() and torch.isfinite(f32).all(), f"{md.path.name}: NaN or inf in the logits"
            assert d32 <= 1e-4, f"{md.path.name}: float32 on the device is {d32:.3g} from the CPU (> 1e-4)"
            assert dlow <= 2 * rounding + 1e-3, (f"{md.path.name}: {eng.precision.name} on the device is {dlow:.3g} from "
                                                 f"{eng.precision.name} on the CPU, more than 2x its rounding ({rounding:.3g})")
            out.append(f"{md.path.name}: float32 {d32:.2g}, {eng.precision.name} {dlow:.2g} (rounding {rounding:.2g})")
        return "; ".join(out)

    def tune(self):
        runs = {}
        for side, engine in (("device", "auto" if not self.rehearse else "torch-cpu"), ("cpu", "torch-cpu")):
            _, events, _ = self.cli(["tune", str(self.untied.path), str(DATA), *TUNE, "--engine", engine,
                                     "--state", str(self.work / f"tune-{side}"), "--merge"], timeout=200)
            runs[side] = events
        dev = runs["device"]
        wrong = {e["engine"] for e in dev} - {self.engine_name}
        assert not wrong, f"events name engine(s) {wrong}, not {self.engine_name}"
        losses = [e["loss"] for e in dev if e["event"] == "step"]
        cpu = [e["loss"] for e in runs["cpu"] if e["event"] == "step"]
        assert len(losses) == 30 and all(math.isfinite(x) for x in losses), f"losses: {losses}"
        worst = max(abs(a - b) / max(abs(b), 1e-6) for a, b in zip(losses, cpu))
        assert worst <= 0.05, f"a loss is {worst:.1%} from torch-cpu's (> 5%)"
        steps = [e for e in dev if e["event"] == "step"]
        self.figures["tune_tiny"] = {"tokens_per_s": sorted(e["tokens_per_s"] for e in steps[3:])[len(steps[3:]) // 2],
                                     "peak_mem_gb": max(e["peak_mem_gb"] for e in steps)}
        return f"loss {losses[0]:.4f} -> {losses[-1]:.4f}, worst step {worst:.2%} from torch-cpu's"

    def resume(self):
        ref = self.work / "tune-device"
        state = self.work / "tune-resumed"
        args = ["tune", str(self.untied.path), str(DATA), *TUNE, "--engine", self.engine_name, "--state", str(state), "--merge"]
        env = {**os.environ, "SPILLPACK_HEADLESS": "1", "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
        p = subprocess.Popen([sys.executable, "-m", "spillpack", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=env, cwd=REPO)
        sent = False
        for line in p.stdout:
            e = json.loads(line)
            if not sent and e["event"] == "step" and e["step"] >= 11:
                p.send_signal(signal.SIGTERM)
                sent = True
        rc = p.wait(timeout=120 * self.slow)
        assert sent and rc == 75, f"SIGTERM at step 11: exit {rc}, {p.stderr.read().strip()[-300:]}"
        _, events, _ = self.cli(args, timeout=200)
        restored = [e["step"] for e in events if e["event"] == "restore"]
        assert restored, "the rerun did not restore"
        a, b = _adapter(ref), _adapter(state)
        diff = [k for k in a if not np.array_equal(a[k], b[k])]
        assert not diff, f"{len(diff)} adapter tensors differ from the uninterrupted run, e.g. {diff[0]}"
        assert _losses(ref) == _losses(state), "the losses differ from the uninterrupted run"
        return f"stopped at step {restored[0]}, resumed: adapter and 30 losses bit-identical"

    def merge(self):
        from safetensors.numpy import load_file

        state = self.work / "tune-resumed"
        merged = load_file(str(state / "adapter" / "merged" / "model.safetensors"))
        adapter = load_adapter(state / "adapter")
        tensors, spec = adapter
        base = {k: v.numpy() for k, v in load_checkpoint(self.untied, torch.float32, "cpu").items()}
        worst = 0.0
        for k, w in merged.items():
            module = k.removesuffix(".weight")
            if f"{module}.lora_A.weight" in tensors:
                want = base[k] + spec.scale * (tensors[f"{module}.lora_B.weight"] @ tensors[f"{module}.lora_A.weight"])
                worst = max(worst, float(np.abs(w - want).max()))
            else:
                assert np.array_equal(w, base[k]), f"{k} is not the checkpoint's tensor"
        assert worst <= 1e-6, f"a merged tensor is {worst:.3g} from the checkpoint's + scale B A"
        return f"{len(merged)} tensors, adapted ones within {worst:.2g}"

    def generate(self):
        md = self.untied
        tok = Tokenizer.from_dir(md.path)
        spec = LoraSpec(4, 8.0, ("q_proj", "v_proj"))
        rng = np.random.default_rng(1)
        lora = {k: (v if "lora_A" in k else rng.normal(0, 0.05, v.shape).astype(np.float32))
                for k, v in init_tensors(md.config, spec, 0).items()}
        requests = [Request(str(i), rng.integers(5, 900, size=int(rng.integers(3, 40))).tolist(), 16,
                            temperature=0.0 if i % 2 else 0.8, seed=7) for i in range(12)]

        def tokens(engine, adapter, every_slot=None):
            model = engine.load_model(md, adapter)
            gen = Generator(TorchDecoder(model, 4, 64, every_slot=every_slot), tok)
            for r in requests:
                gen.add(r)
            out = {}
            while gen.active:
                out.update({r.key: r.tokens for r in gen.step()})
            return out

        report = []
        for adapter in (None, (lora, spec)):
            cpu = tokens(get_engine("torch-cpu"), adapter)
            f32 = self.engine(torch.float32)
            on_dev, rows_path = tokens(f32, adapter), tokens(f32, adapter, every_slot=False)
            same = sum(cpu[k] == on_dev[k] for k in cpu)
            assert same == len(cpu), f"{'with' if adapter else 'without'} adapter: {same}/{len(cpu)} rows identical to the CPU"
            assert rows_path == on_dev, "the every-slot decode path differs from the running-rows path"
            low = tokens(self.engine(), adapter)
            assert all(len(low[k]) == len(cpu[k]) or len(low[k]) <= 16 for k in cpu) and len(low) == len(cpu)
            report.append(f"{'adapter' if adapter else 'base'}: float32 {same}/{len(cpu)} identical, "
                          f"{self.engine().precision.name} {sum(cpu[k] == low[k] for k in cpu)}/{len(cpu)}")
        return "; ".join(report)

    def figures_05b(self):
        md = resolve_model(str(make_qwen05(self.work / "qwen05")))
        eng = self.engine()
        spec = LoraSpec(16, 32.0, ("q_proj", "k_proj", "v_proj", "o_proj"))
        session = eng.train_session(md, spec, init_tensors(md.config, spec, 0), OptimSpec())
        rng = np.random.default_rng(0)
        ids = rng.integers(0, md.config["vocab_size"], size=(4, 256))
        mbs, steps = [(ids, ids.copy())], (2 if self.rehearse else 10)
        session.forward_backward(mbs, ids.size)
        session.apply(1e-4)
        _sync(self.device)
        t0 = time.perf_counter()
        for s in range(steps):
            session.forward_backward(mbs, ids.size, s)
            session.apply(1e-4)
        _sync(self.device)
        tune = steps * ids.size / (time.perf_counter() - t0)
        peak = eng.peak_mem_gb()
        del session  # its blocks go back to the allocator; the next engine's reset returns them to the device
        gen_engine = self.engine()
        gen = gen_engine.generator(md, Tokenizer.from_dir(md.path), slots=8, max_len=128)
        for i in range(8 if self.rehearse else 32):
            gen.add(Request(str(i), rng.integers(5, 900, size=32).tolist(), 8 if self.rehearse else 64))
        t0, made = time.perf_counter(), 0
        while gen.active:
            made += sum(r.completion_tokens for r in gen.step())
        gen_rate = made / (time.perf_counter() - t0)
        self.figures["qwen2.5-0.5b"] = {"tune_tokens_per_s": round(tune, 1), "peak_mem_gb": round(peak, 2),
                                        "generate_tokens_per_s": round(gen_rate, 1), "dtype": eng.precision.name,
                                        "generate_peak_mem_gb": round(gen_engine.peak_mem_gb(), 2)}
        return (f"Qwen2.5-0.5B shape, {eng.precision.name}: tune {tune:.0f} tokens/s (batch 4 x 256, LoRA r16 q/k/v/o), "
                f"peak reserved {peak:.2f} GB; generate {gen_rate:.0f} tokens/s (8 slots)")


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _adapter(state: Path) -> dict:
    from safetensors.numpy import load_file

    return load_file(str(state / "adapter" / "adapter_model.safetensors"))


def _losses(state: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (state / "adapter" / "train_log.jsonl").read_text().splitlines()]


def write_model(out: Path, config: dict, seed: int = 0) -> Path:
    """A random Llama-architecture HF directory (tiny's tokenizer), numpy only: no transformers needed."""
    from safetensors.numpy import save_file

    if (out / "config.json").exists():
        return out
    tiny = ensure_tiny()
    cfg = {**json.loads((tiny / "config.json").read_text()), **config}
    out.mkdir(parents=True)
    h, i, L, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    hd = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd
    rng = np.random.default_rng(seed)
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, h)
    for layer in range(L):
        p = f"model.layers.{layer}."
        shapes.update({p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.v_proj.weight": (kv, h),
                       p + "self_attn.o_proj.weight": (h, h), p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                       p + "mlp.down_proj.weight": (h, i), p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
        if cfg["model_type"] == "qwen2":
            shapes.update({p + "self_attn.q_proj.bias": (h,), p + "self_attn.k_proj.bias": (kv,), p + "self_attn.v_proj.bias": (kv,)})
    tensors = {k: np.ones(s, np.float32) if k.endswith("norm.weight") else
               (rng.standard_normal(s, dtype=np.float32) * 0.02) for k, s in shapes.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, out / name)
    return out


def make_qwen05(out: Path) -> Path:
    return write_model(out, {**QWEN05, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rehearse-on-cpu", action="store_true", help="run the script's logic with the CPU standing in for the GPU")
    ap.add_argument("--skip-figures", action="store_true", help="skip the Qwen2.5-0.5B figures")
    ap.add_argument("--json", help="write the figures here too")
    a = ap.parse_args()
    if not a.rehearse_on_cpu and not torch.cuda.is_available():
        print("FAIL cuda: torch.cuda.is_available() is False; `python -m spillpack doctor` says why", flush=True)
        return 1
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    os.environ["SPILLPACK_HOME"] = str(work / "home")
    t0 = time.monotonic()
    c = Check(a.rehearse_on_cpu, work)
    where = "a CPU rehearsal (not the GPU check)" if c.rehearse else torch.cuda.get_device_name(0)
    print(f"gpu_check on {where}: torch {torch.__version__}, CUDA {torch.version.cuda}", flush=True)
    # An untied head, Llama-3 shape (q/k/v without biases): what tiny (tied, Qwen2) leaves out.
    c.untied = resolve_model(str(write_model(work / "untied", {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 128, "intermediate_size": 352,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False}, seed=5)))
    for name, fn in (("doctor", c.doctor), ("logits", c.logits), ("tune", c.tune), ("resume", c.resume), ("merge", c.merge),
                     ("generate", c.generate)):
        c.run(name, fn)
    if not a.skip_figures:
        c.run("figures", c.figures_05b)
    if a.json:
        Path(a.json).write_text(json.dumps(c.figures, indent=2) + "\n")
    print(json.dumps(c.figures), flush=True)
    shutil.rmtree(work, ignore_errors=True)
    verdict = f"FAILED: {', '.join(c.failures)}" if c.failures else "all checks passed"
    print(f"gpu_check: {verdict} in {time.monotonic() - t0:.0f}s", flush=True)
    return 1 if c.failures else 0


if __name__ == "__main__":
    sys.exit(main())
