"""LoRA dropout's masks: counter-based, a pure function of what a token is, never a generator's state.

An element of the mask on an adapted linear's input is kept when

    ((token_key[b, t] ^ feature_key[i]) * MUL) < threshold(p)    (int32 arithmetic, wrapping)

token_key(seed, step, row, position): the row's place among its step's rows (the same whether
the step runs 4 x 1, 2 x 2 or 1 x 4, and on whichever rank of a data-parallel group computes
it), its position in the row (padding after a row never moves its tokens);
feature_key(module, i): the adapted module's name (its layer and linear) and the input feature.
Both keys are fully mixed (lowbias32) on the host; the per-element step is one xor and one
multiply, so a mask costs about what drawing one from a generator did. Consequences:
- a layer recomputed in backward (--grad-checkpoint) draws exactly the forward's mask;
- a resumed step, a step cut into other micro-batches and a step spread over other ranks draw
  the same masks: the results do not depend on any of them;
- torch and MLX compute the same masks (the same integer arithmetic), so a checkpoint means
  the same on either engine with dropout too.
`keep_mask` works on torch, mlx and numpy int32 arrays alike (operators only).
"""

from __future__ import annotations

import hashlib

import numpy as np

MUL = 0x7FEB352D  # odd, below 2**31: a plain int32 multiplier in every framework
_M32 = 0xFFFFFFFF


def mix32(x: np.ndarray) -> np.ndarray:
    """lowbias32 (Chris Wellons' hash prospector): a bijection on uint32 with strong avalanche."""
    x = np.asarray(x, dtype=np.uint32)
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x7FEB352D)
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(0x846CA68B)
    return x ^ (x >> np.uint32(16))


def _key(*parts: int) -> np.uint32:
    return np.uint32(np.random.SeedSequence([*parts, 0xD0]).generate_state(1)[0])


def token_keys(seed: int, step: int, rows: np.ndarray, length: int) -> np.ndarray:
    """(B, T) int32 keys of the tokens of rows `rows` (their places in step `step`), T = `length`."""
    per_row = mix32(_key(seed, step) ^ np.asarray(rows, dtype=np.uint32))  # (B,)
    return mix32(per_row[:, None] ^ mix32(np.arange(length, dtype=np.uint32))[None, :]).view(np.int32)


def feature_keys(module: str, width: int) -> np.ndarray:
    """(width,) int32 keys of an adapted module's input features, from its canonical name."""
    k = np.uint32(int.from_bytes(hashlib.sha256(module.encode()).digest()[:4], "little"))
    return mix32(mix32(np.arange(width, dtype=np.uint32) ^ k)).view(np.int32)


def threshold(p: float) -> int:
    """int32 products below this are kept: a share 1 - p of the 2**32 values."""
    return min(round((1 - p) * 2**32) - 2**31, 2**31 - 1)


def keep_mask(tokens, features, p: float):
    """Boolean (..., T, width) keep-mask for token keys (..., T) and feature keys (width,), in
    the arrays' own framework (torch, mlx or numpy int32)."""
    return ((tokens[..., None] ^ features) * MUL) < threshold(p)
