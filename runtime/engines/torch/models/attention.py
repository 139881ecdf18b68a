"""The attention pieces every torch family shares: the KV cache, the masks, the decode step's
attention, and the packed step that starts prompts inside a decode step."""

from __future__ import annotations

import mmap
import math

import numpy as np
import torch
import torch.nn.functional as F

from runtime.models.args import ModelArgs


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A zeroed tensor whose CPU pages become resident only when written.

    torch.zeros writes every byte, so a cache planned for the longest row in every slot is
    resident in full from the start. A private anonymous mapping starts as the kernel's zero
    page: positions no row writes cost no memory, even where a decode step's key span reads
    them. (Not mmap's default, a shared mapping, whose pages are allocated on a read; nor numpy's
    calloc, which asks for transparent huge pages, so one write faults in 2 MB.)"""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # The tensor holds the mapping alive (frombuffer keeps a reference to its buffer).
    return torch.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=dtype).view(shape)


class KVCache:
    """Preallocated keys and values for every layer, with one length per row.

    Rows may hold sequences of different lengths (continuous batching); new tokens of row b
    are written at positions lengths[b]..lengths[b]+T-1. Keys past a row's length are garbage
    and are masked out by the model, so a slot can be reused without clearing it.
    """

    def __init__(self, args: ModelArgs, batch: int, max_len: int, dtype=torch.float32, device="cpu"):
        shape = (args.num_hidden_layers, batch, args.num_key_value_heads, max_len, args.head_dim)
        self.k = zeros(shape, dtype, device)
        self.v = zeros(shape, dtype, device)
        # Each layer's keys and values as (slots * kv_heads * max_len, head_dim) views, for store's
        # index_copy_: made once, not per layer per forward.
        self.flat = [(self.k[i].view(-1, args.head_dim), self.v[i].view(-1, args.head_dim)) for i in range(shape[0])]
        self._written = None  # (positions, flat indices) of the last write: see _flat_index
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.max_len = max_len
        self.all_rows = torch.arange(batch, device=device)
        self.index = None  # the slots a view covers (None: all of them, in order)
        # The next forward's key span when the caller knows its rows' lengths on the host (the
        # decoder does): reading it from `lengths` would stop the host until the device catches up.
        self.next_span: int | None = None

    def view(self, slots: list[int]) -> "KVCache":
        """Some slots, in the given order, as one batch: writes land in this cache's storage.

        The view's lengths are a copy (advanced indexing), so the caller stores them back
        with `self.lengths[slots] = view.lengths` after a forward.
        """
        if slots == list(range(self.k.shape[1])):
            return self
        view = KVCache.__new__(KVCache)
        view.k, view.v, view.flat, view.max_len = self.k, self.v, self.flat, self.max_len
        view.index = torch.tensor(slots, device=self.k.device)
        view.lengths = self.lengths[view.index]
        view.next_span = None
        view._written = None
        return view

    def reads_in_place(self) -> bool:
        """Whether a decode step over this view's rows attends every slot's keys where they lie
        (`rows_attention`) rather than a gathered copy of its rows' keys."""
        return self.index is not None and 2 * len(self.index) >= self.k.shape[1]

    def decode_bias(self, S: int, window: int | None, dtype):
        """decode_bias for a decode step over this cache's rows: over every slot where the step
        reads the keys in place (the other slots' entries any finite bias: their outputs are dropped)."""
        offsets = self.lengths
        if self.reads_in_place():
            offsets = torch.zeros(self.k.shape[1], dtype=offsets.dtype, device=offsets.device).index_copy_(0, self.index, offsets)
        return decode_bias(offsets, S, window, self.k.shape[2], dtype)

    def decode(self, layer: int, q, k, v, slots: torch.Tensor, span: int, bias, scale: float, blas: bool):
        """A decode step's attention (q, k, v (B, heads, 1, head_dim)): the new keys stored, then each
        row's query over its slot's keys up to `span`; bias: this cache's decode_bias."""
        rows = self.all_rows if self.index is None else self.index
        store(self, layer, k, v, self._flat_index(rows, slots))
        keys, values = self.k[layer, :, :, :span], self.v[layer, :, :, :span]
        return rows_attention(q, keys, values, self.index, self.reads_in_place(), bias, scale, blas)

    def write(self, layer: int, k, v, slots: torch.Tensor, span: int):
        """Store k, v (B, kv_heads, T, head_dim) at `slots` (B, T); return keys/values up to `span`."""
        rows = self.all_rows if self.index is None else self.index
        store(self, layer, k, v, self._flat_index(rows, slots))
        if self.index is None:
            return self.k[layer, :, :, :span], self.v[layer, :, :, :span]  # (B, kv_heads, S, head_dim)
        return self.k[layer, :, :, :span][rows], self.v[layer, :, :, :span][rows]  # a gathered copy

    def _flat_index(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """flat_index's for these rows and positions, made once per forward: every layer of one
        forward writes at the same positions (the same tensor), so the first layer's is reused."""
        if self._written is None or self._written[0] is not positions:
            self._written = positions, flat_index(rows, positions, self.k.shape[2], self.max_len)
        return self._written[1]


def flat_index(rows: torch.Tensor, positions: torch.Tensor, kv_heads: int, max_len: int) -> torch.Tensor:
    """Where token t of row b lands for each kv head, as indices into one layer's cache flattened
    to (slots * kv_heads * max_len, head_dim): (B, kv_heads, T) -> B * kv_heads * T, in k's order.
    rows: each row's slot (B,), or each token's (B, T) (a packed step); positions (B, T): each
    token's cache position."""
    heads = torch.arange(kv_heads, device=positions.device)
    rows = rows[:, None] if rows.dim() == 1 else rows  # (B, 1) or (B, T)
    return ((rows[:, None, :] * kv_heads + heads[None, :, None]) * max_len + positions[:, None, :]).reshape(-1)


def store(cache: KVCache, layer: int, k, v, index: torch.Tensor) -> None:
    """Write k, v (B, kv_heads, T, head_dim) into one layer at `index` (flat_index's). One
    index_copy_ per tensor: the advanced-index assignment it replaces cost about 25 us a call on
    tiny's decode step (broadcast indices built and checked every layer), most of the write."""
    hd = k.shape[-1]
    keys, values = cache.flat[layer]
    keys.index_copy_(0, index, k.reshape(-1, hd))
    values.index_copy_(0, index, v.reshape(-1, hd))


def packed_layout(slots: list[int], lengths: list[int], pieces: list[tuple[int, int, int]]):
    """A packed step's tokens: one per decoding row (slots, at their lengths), then each piece
    (slot, start, n) of a prompt from position `start`. Returns the parts (slot, start, n, index of
    the piece's first token), and each token's slot and position."""
    rows, positions, parts = list(slots), [int(n) for n in lengths], []
    for slot, start, n in pieces:
        parts.append((slot, start, n, len(rows)))
        rows += [slot] * n
        positions += range(start, start + n)
    return parts, rows, positions


class PackedStep:
    """One forward whose tokens are packed end to end as one (1, N) sequence, no padding: first one
    token for each decoding row, then the piece of each prompt starting in its slot. A decode step
    and the prefill of the rows that start beside it share every linear, norm and MLP call; only
    attention runs per part, the decoding rows together (decode_attention) and each piece on its
    own (SDPA, causal from its offset). On a small model, whose step is op calls more than
    arithmetic, this takes a whole forward per started row out of continuous batching.

    `lengths`: each decoding row's cached tokens; `starts`: each piece's (its prefix reuse);
    `span`: the keys the decoding rows attend (the decoder rounds it)."""

    def __init__(self, cache: KVCache, slots: list[int], lengths: list[int], new_slots: list[int],
                 starts: list[int], pieces: list[int], span: int):
        device = cache.k.device
        self.cache, self.decoding, self.span = cache, len(slots), span
        self.parts, rows, positions = packed_layout(slots, lengths, list(zip(new_slots, starts, pieces)))
        self.rows = torch.tensor(rows, device=device)
        self.positions = torch.tensor(positions, device=device)[None]  # (1, N): rotary positions too
        # Packed token n lands in slot rows[n] at positions[n]: k, v are (1, kv_heads, N, head_dim).
        self.index = flat_index(self.rows[None], self.positions, cache.k.shape[2], cache.max_len)
        self.slot_index = torch.tensor(slots, device=device)
        self.lengths = torch.tensor(lengths, device=device)
        # With most slots decoding, their attention reads the keys in place (rows_attention).
        self.in_place = 2 * self.decoding >= cache.k.shape[1]  # as KVCache.reads_in_place
        if self.in_place:  # each slot's cached tokens, the decoding rows' at their slots (decode_bias)
            self.lengths = torch.zeros(cache.k.shape[1], dtype=torch.long, device=device).index_copy_(0, self.slot_index, self.lengths)
        self._masks = {}

    def _masks_for(self, window, dtype, kv_heads):
        """(decode_bias of the decoding rows, one SDPA mask or None per piece), made once per step."""
        key = (window, dtype)
        if key not in self._masks:
            device = self.rows.device
            bias = None
            if self.decoding:
                bias = decode_bias(self.lengths, self.span, window, kv_heads, dtype)
            pieces = [None if start == 0 and (window is None or window >= n)
                      else build_mask(n, start + n, torch.tensor([start], device=device), None, device, window)
                      for _, start, n, _ in self.parts]
            self._masks[key] = bias, pieces
        return self._masks[key]

    def attend(self, layer: int, q, k, v, scale: float, window, blas: bool = False):
        """Store this step's keys and values in the cache, then each part's attention; (1, heads, N, head_dim)."""
        store(self.cache, layer, k, v, self.index)  # k, v (1, kv_heads, N, head_dim)
        bias, masks = self._masks_for(window, q.dtype, k.shape[1])
        outs = []
        if self.decoding:
            n = self.decoding
            queries = q[0, :, :n].transpose(0, 1).unsqueeze(2)  # (n, H, 1, hd)
            keys, values = self.cache.k[layer, :, :, :self.span], self.cache.v[layer, :, :, :self.span]
            out = rows_attention(queries, keys, values, self.slot_index, self.in_place, bias, scale, blas)
            outs.append(out.squeeze(2).transpose(0, 1).unsqueeze(0))
        for (slot, start, n, at), mask in zip(self.parts, masks):
            keys = self.cache.k[layer, slot:slot + 1, :, :start + n]
            values = self.cache.v[layer, slot:slot + 1, :, :start + n]
            outs.append(F.scaled_dot_product_attention(q[:, :, at:at + n], keys, values, attn_mask=mask,
                                                       is_causal=mask is None, enable_gqa=True, scale=scale))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def rows_attention(q, keys, values, rows, in_place: bool, bias, scale, blas: bool):
    """decode_attention of q (n, heads, 1, head_dim), row i's query over slot rows[i]'s keys of
    `keys` and `values` (slots, kv_heads, S, head_dim), a layer's cache; rows None: every slot, in
    order. `in_place`: every slot's keys read where they lie, the other slots' queries zero and
    their outputs dropped (bias over every slot); else the rows' keys gathered first (bias over
    the rows). The gather copies a layer's whole key span for each row (tiny, 7 of 8 slots
    decoding beside a new prompt: about 5% of the step); reading in place costs the idle slots'
    products, a few rows more while most slots decode."""
    if rows is None:
        return decode_attention(q, keys, values, bias, scale, blas)
    if in_place:
        every = q.new_zeros((keys.shape[0], *q.shape[1:])).index_copy_(0, rows, q)
        return decode_attention(every, keys, values, bias, scale, blas).index_select(0, rows)
    return decode_attention(q, keys[rows], values[rows], bias, scale, blas)


def decode_attention(q, k, v, bias, scale, blas: bool = False):
    """Attention of one query per row, (B, heads, 1, head_dim), over (B, kv_heads, S, head_dim);
    `bias` (B * kv_heads, 1, S): 0 where a key is seen, -inf where not (`decode_bias`).

    The same result as SDPA with the mask; on CPU, torch's flash kernel spends ~0.3 ms per call
    on a single query, most of a small model's decode step, where these three ops take a tenth.
    Rows and kv heads flattened into one batch make the cached keys (a slice of the cache) a
    view that bmm reads in place, where a 4-d matmul copied them (tiny, 8 rows: 60 -> 22 us per
    layer), and baddbmm scales and masks as it multiplies. On CUDA, SDPA with a boolean mask and
    grouped kv heads falls back to its math kernel, which copies the keys and values out to
    every query head; grouping the queries instead reads them once. `blas` (the layer's
    decode_blas, set by layout.cpu_inference_layout where numpy's BLAS runs such small products
    faster: small_gemm): the two products run there on a float32 CPU tensor outside autograd
    (tiny, 8 rows, one thread, AMD EPYC: the scores 22.3 -> 9.3 us a layer).
    """
    blas = blas and q.device.type == "cpu" and q.dtype == torch.float32 and not torch.is_grad_enabled()
    return decode_products(q, k, v, bias, scale, blas)


def decode_products(q, k, v, bias, scale, blas: bool):
    """decode_attention's arithmetic, its two products on numpy's BLAS (`blas`) or on torch's bmm."""
    B, H, _, hd = q.shape
    kv_heads, S = k.shape[1], k.shape[2]
    if blas:  # the reshapes and transposes in numpy too, where they cost a tenth of torch's
        qn, kn, vn = (t.numpy().reshape(B * kv_heads, -1, hd) for t in (q, k, v))
        scores = torch.add(bias, torch.from_numpy(np.matmul(qn, kn.transpose(0, 2, 1))), alpha=scale)
        return torch.from_numpy(np.matmul(scores.softmax(-1).numpy(), vn).reshape(B, H, 1, hd))
    q = q.reshape(B * kv_heads, H // kv_heads, hd)  # query heads grouped by the kv head they share
    keys, values = k.reshape(B * kv_heads, S, hd), v.reshape(B * kv_heads, S, hd)
    scores = torch.baddbmm(bias, q, keys.transpose(1, 2), alpha=scale)  # (B*kv, group, S)
    return torch.bmm(scores.softmax(-1), values).view(B, H, 1, hd)


def decode_bias(offsets, S: int, window: int | None, kv_heads: int, dtype):
    """decode_attention's additive (B * kv_heads, 1, S) bias for one query per row at key index
    offsets[b] (its cached tokens): 0 where build_mask would let it attend, -inf elsewhere. Made
    once per step and read by every layer; built from the offsets directly, in a few ops."""
    B = offsets.shape[0]
    k_idx = torch.arange(S, device=offsets.device)[None, :]
    hidden = k_idx > offsets[:, None]  # keys after the row's new one
    if window is not None:
        hidden |= k_idx <= offsets[:, None] - window
    bias = torch.zeros((B, S), dtype=dtype, device=offsets.device).masked_fill_(hidden, float("-inf"))
    return bias[:, None].expand(B, kv_heads, S).reshape(B * kv_heads, 1, S)


def build_mask(T: int, S: int, offsets, attn_mask, device, window: int | None = None):
    """Boolean (B, 1, T, S) mask, True where a query may attend a key.

    Query t of row b sits at key index offsets[b] + t (offsets: tokens already cached) and sees
    keys up to itself (with a sliding window, only the `window` keys ending at itself, as
    transformers counts them: key index > query index - window). `attn_mask` (B, S), 1 for real tokens and 0 for padding, hides pad keys.
    Every query keeps its own key even if it is padding, so no row is fully masked (softmax
    over nothing is NaN, and a NaN in a pad row would poison gradients); pad rows' outputs are
    never used.
    """
    q_idx = offsets[:, None] + torch.arange(T, device=device)[None, :]  # (B, T)
    k_idx = torch.arange(S, device=device)  # (S,)
    allowed = k_idx[None, None, :] <= q_idx[:, :, None]  # (B, T, S)
    if window is not None:
        allowed = allowed & (k_idx[None, None, :] > q_idx[:, :, None] - window)
    if attn_mask is not None:
        allowed = allowed & attn_mask.bool()[:, None, :]
        allowed = allowed | (k_idx[None, None, :] == q_idx[:, :, None])
    return allowed[:, None]  # (B, 1, T, S)
