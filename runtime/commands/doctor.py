"""`spillpack doctor`: a truthful report of this machine for running jobs."""

import platform
import sys

from runtime import __version__
from runtime.base.allotment import cpus
from runtime.base.threads import job_threads
from runtime.engines.hardware import ENGINE_NAMES, choose_engine, cuda_facts, disk_free_gb, measure, memory_for, memory_gb, probe, remember_rate
from runtime.engines.nvidia import CudaFacts
from runtime.base.paths import spillpack_home


def add_arguments(p):
    p.add_argument("--engine", default="auto", help="check the choice as a job with this --engine would make it")
    p.add_argument("--no-measure", action="store_true", help="skip the short matmul and memory-bandwidth measurement")


def cpu_dtype_policy(measure_rates: bool) -> dict:
    """What torch-cpu's `--dtype auto` picks here (runtime/engines/torch/precision.py), and the
    bfloat16 matmul rate where the CPU has it natively (remembered for bfloat16 jobs' estimates)."""
    from runtime.engines.torch.precision import BF16_MIN_WIDTH, cpu_bf16_native

    native = cpu_bf16_native()
    out = {"bf16_native": native,
           "dtype_auto": (f"for models {BF16_MIN_WIDTH} or more wide (native {native}): a tune bfloat16, a row job's "
                          f"generation whichever dtype a decode step of the model's shapes measures faster here "
                          f"(once per shape, kept); float32 below" if native
                          else "float32 (this CPU has no native bfloat16 matmul)")}
    if native:
        from runtime.engines.torch.decode_dtype import cached_choices

        out["decode_dtype"] = cached_choices()
    if native and measure_rates:
        rate = measure("torch-cpu", dtype="bfloat16")
        remember_rate("torch-cpu", rate, "bfloat16")
        out["bf16_matmul_gflops"] = rate["matmul_gflops"]
    if measure_rates:
        from runtime.engines.torch.models.small_gemm import describe

        out["small_gemm"] = describe()
        from runtime.engines.torch.models.quant_linear import describe as quant_gemm

        out["quant_gemm"] = quant_gemm("bfloat16" if native else "float32")  # a quantized GGUF's kernels
    return out


def report(engine: str = "auto", measure_rates: bool = True, cuda: CudaFacts | None = None) -> dict:
    """`cuda`: the facts torch-cuda is judged from (this machine's when not given)."""
    total, available = memory_gb()
    cuda = cuda if cuda is not None else cuda_facts()
    probes = [probe(n, cuda) for n in ENGINE_NAMES]
    engines = {}
    for p in probes:
        engines[p.name] = {"usable": p.usable, "detail": p.detail}
        if p.fix:
            engines[p.name]["fix"] = p.fix
        if p.usable and measure_rates:
            try:
                rate = measure(p.name)
            except Exception as e:  # usable by probe but failing to compute is worth saying, not crashing on
                engines[p.name].update(usable=False, detail=f"{p.detail}; but a test matmul failed: {e}")
            else:
                engines[p.name].update(rate)
                remember_rate(p.name, rate)  # later jobs' estimated_seconds use it
        if p.name == "torch-cpu" and p.usable:
            engines[p.name].update(cpu_dtype_policy(measure_rates))
    try:
        chosen, why = choose_engine(engine, cuda)
    except Exception as e:
        chosen, why = None, str(e)
    plan_gb, plan_from = (None, None)
    if chosen:
        try:
            plan_gb, plan_from, _ = memory_for(chosen)
        except Exception as e:  # a device that cannot say its free memory is worth saying, not crashing on
            plan_from = f"unknown ({e})"
    allotted = cpus()
    threads = job_threads(allotted.count)
    return {
        "spillpack": __version__,
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "machine": f"{platform.system()} {platform.machine()}",
        "cpus": allotted.count,
        "cpus_from": allotted.source,  # "cores", or the affinity mask / cgroup CPU quota that allots fewer
        # torch-cpu's threads: the allotted CPUs found free, or SPILLPACK_THREADS / OMP_NUM_THREADS
        "threads": threads.count,
        "threads_why": threads.why,
        "memory_gb": round(total, 1),
        "memory_available_gb": round(available, 1),
        "home": str(spillpack_home()),
        "disk_free_gb": round(disk_free_gb(), 1),
        "engines": engines,
        "engine": chosen,
        "engine_reason": why,
        "plan_memory_gb": None if plan_gb is None else round(plan_gb, 1),  # what a tune here is sized against
        "plan_memory_from": plan_from,
    }


def main(ns: dict, events) -> int:
    r = report(ns.get("engine", "auto"), not ns.get("no_measure"))
    if events.headless:
        events.emit("doctor", **r)  # an event like every command's: its `engine` is the one a job would use here
        return 0
    lines = [
        f"spillpack {r['spillpack']} on {r['machine']}, Python {r['python']} ({r['executable']})",
        f"cpus {r['cpus']}, memory {r['memory_available_gb']} GB free of {r['memory_gb']} GB, "
        f"disk {r['disk_free_gb']} GB free at {r['home']}",
        f"torch-cpu threads {r['threads']}: {r['threads_why']}",
        "engines:",
    ]
    for name, e in r["engines"].items():
        mark = "*" if name == r["engine"] else ("+" if e["usable"] else "-")
        rate = (f" ({e['matmul_gflops']} GFLOP/s {e['matmul_dtype']} matmul, {e['mem_gbps']} GB/s memory)"
                if "matmul_gflops" in e else "")
        lines.append(f"  {mark} {name:<11} {'usable' if e['usable'] else 'not usable'}: {e['detail']}{rate}")
        if "dtype_auto" in e:
            bf16 = f" (bfloat16 matmul {e['bf16_matmul_gflops']} GFLOP/s)" if "bf16_matmul_gflops" in e else ""
            lines.append(f"    base dtype (--dtype auto): {e['dtype_auto']}{bf16}")
            for shape, said in e.get("decode_dtype", {}).items():
                lines.append(f"    generation measured: {said} [{shape}]")
        if e.get("fix"):
            lines.append(f"    try: {e['fix']}")
    lines.append(f"a job here would use {r['engine']}: {r['engine_reason']}" if r["engine"] else f"no engine: {r['engine_reason']}")
    if r["plan_memory_gb"] is not None:
        lines.append(f"a tune here is sized for {r['plan_memory_gb']} GB ({r['plan_memory_from']}); "
                     f"spillpack tune ... --plan shows a job's plan")
    print("\n".join(lines))
    return 0
