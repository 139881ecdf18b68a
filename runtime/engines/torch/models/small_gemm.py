"""Whether a float32 CPU base's small products of inference run on numpy's BLAS instead of MKL.

A small model's decode step is products of a few rows by weights of a few hundred columns
(tiny at 8 rows: 8 x 128 by 128 x 704) and, in attention, of a few queries by the cached keys.
MKL's sgemm spends a fixed cost per call that such products never amortize, and at two threads
under the passive wait policy each call also wakes a sleeping OpenMP thread. Measured on a 2-core
AMD EPYC (Zen 4, AVX-512),
one thread, per call: tiny's gate/up 8 x 128 by 128 x 704 MKL 28.6 us, numpy's OpenBLAS 14.3;
q/k/v (to 256) 10.1 -> 6.0; down (352 -> 128) 13.1 -> 11.4; the head (to 1003) 39.4 -> 37.3; a
decode step's scores at 8 rows (16 batches of 2 x 32 by 32 x 192) as bmm 22.3 us, as numpy's
matmul 9.3. At a tune's 720 rows the two are within 10% of each other (one thread), so this is
for inference only; weights of PACK_MIN_WEIGHTS or more run on oneDNN whatever this says.

Which is faster depends on the CPU and on MKL's dispatch there, so it is measured, once per
machine, torch version and thread count, on those shapes, and kept in the rates cache
(runtime.engines.hardware): a job's choice does not move with a noisy minute. numpy's BLAS
must be faster by MARGIN to be chosen; `SPILLPACK_SMALL_GEMM=blas|mkl` chooses instead. Its own
threads are held to one by the entry points (runtime.base.threads.BEFORE_TORCH:
OPENBLAS_NUM_THREADS), so nothing of it spins beside torch's OpenMP threads; each of these
products is too small to split anyway.

End to end (tiny, `run` of 128 rows at 8 slots, both layouts in one process, alternating): at two
threads 1.71x faster at equal lengths and 1.54x mixed; at one thread no measurable difference.
"""

from __future__ import annotations

import functools
import time

import torch
import torch.nn.functional as F

# numpy's BLAS is chosen where MKL takes this much longer over the shapes below (this 2-core AMD
# EPYC measured 1.15-1.35x at one thread and 4.5x at two)
MARGIN = 1.1
KERNELS = ("blas", "mkl")


def best_seconds(fn, repeats: int = 60, warmup: int = 10) -> float:
    """The fastest of `repeats` calls of fn, after `warmup` (the measurements of the kernel choices)."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure() -> dict:
    """Seconds per decode step of tiny's shapes at 8 rows (its linears and its attention over 256
    cached keys), on MKL and on numpy's BLAS, each product the best of repeats, summed; about
    30 ms in all. The attention is decode_attention's own arithmetic over a slice of a cache."""
    from runtime.engines.torch.models.attention import decode_products
    from runtime.engines.torch.models.gemm import blas_linear

    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 128, generator=g)
    weights = [torch.randn(n, 128, generator=g).t().contiguous().t() for n in (256, 128, 704, 1003)]
    down = torch.randn(128, 352, generator=g).t().contiguous().t()
    h = torch.randn(8, 352, generator=g)
    q = torch.randn(8, 4, 1, 32, generator=g)
    cache = torch.randn(2, 8, 2, 512, 32, generator=g)  # (k and v, slots, kv heads, max_len, head_dim)
    k, v = cache[0, :, :, :256], cache[1, :, :, :256]
    bias = torch.zeros(16, 1, 256)
    mkl = blas = 0.0
    with torch.inference_mode():
        for w in weights:  # as BlasLinear holds it: the (in, out) numpy view made once at load
            w_t = w.t().numpy()
            mkl += best_seconds(lambda: F.linear(x, w))
            blas += best_seconds(lambda: blas_linear(x, w_t))
        down_t = down.t().numpy()
        mkl += best_seconds(lambda: F.linear(h, down))
        blas += best_seconds(lambda: blas_linear(h, down_t))
        mkl += best_seconds(lambda: decode_products(q, k, v, bias, 0.17, blas=False))
        blas += best_seconds(lambda: decode_products(q, k, v, bias, 0.17, blas=True))
    return {"mkl_s": round(mkl, 7), "blas_s": round(blas, 7)}


def forced_kernel(variable: str, kernels: tuple[str, ...]) -> str | None:
    """The kernel the environment variable names (None where unset); any other value is refused."""
    from runtime.base.errors import env_choice

    return env_choice(variable, kernels)


def _choice() -> tuple[str | None, dict | None]:
    """(the kernel SPILLPACK_SMALL_GEMM names, else None; the measurement, else None)."""
    from runtime.engines.hardware import cached_measurement

    chosen = forced_kernel("SPILLPACK_SMALL_GEMM", KERNELS)
    if chosen:
        return chosen, None
    # "2": measured on decode_attention's products over a cache slice (a cached figure of
    # the first measurement, on plain bmm shapes, is measured again)
    return None, cached_measurement("torch-cpu", f"small gemm 2, {torch.get_num_threads()} threads", measure)


def _kernel(forced: str | None, rates: dict | None) -> str:
    return forced or ("blas" if rates["mkl_s"] >= MARGIN * rates["blas_s"] else "mkl")


def describe() -> str:
    """doctor's line: the kernel and why."""
    forced, m = _choice()
    if forced:
        return f"{forced} (SPILLPACK_SMALL_GEMM)"
    return (f"{_kernel(None, m)}: a decode step's small products took MKL {m['mkl_s'] * 1e6:.0f} us, numpy's BLAS "
            f"{m['blas_s'] * 1e6:.0f} us (numpy's BLAS where MKL takes {MARGIN}x as long)")


@functools.cache
def blas_is_faster() -> bool:
    """Whether this machine's inference runs its small float32 products on numpy's BLAS: measured
    here once (at torch's current thread count) and remembered in the rates cache, unless
    SPILLPACK_SMALL_GEMM says "blas" or "mkl" (any other value is refused)."""
    return _kernel(*_choice()) == "blas"
