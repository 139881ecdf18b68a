"""The torch engine's decoder: what runtime.engines.generation's Generator drives, over one KV cache.

Logits leave as TorchLogits (runtime/engines/logits.py), on the device and in the model's
dtype: the generator takes the greedy argmax there and copies out as float32 only the rows that
sample or carry options; sampling is the generator's, the same code for every engine.

A prefill computes only what the cache does not hold already, and in bounded pieces (a prefix
cache of one entry, and chunks): runtime/engines/prefill.py decides what runs, for every engine;
this decoder supplies the tensor operations.

Two ways to decode a step, the same arithmetic row for row:
- running rows only (a CPU's): the forward covers just the rows asked for, through a view of
  the cache that gathers their keys; on a CPU compute is the cost, so idle slots are skipped;
- every slot (a GPU's): the forward covers the whole cache in place, idle slots computing
  a throwaway token, so no keys are gathered and no slot index is uploaded; the token ids,
  which slots are running and their order travel in one small upload, each row's key span is
  known on the host (no device sync to size the attention), and the one sync per step is the
  logits coming back for the generator's sampling.
"""

from __future__ import annotations

import numpy as np
import torch

from runtime.engines.logits import Logits
from runtime.engines.prefill import PrefixPrefill
from runtime.engines.torch.models.attention import PackedStep, zeros
from runtime.models.memory_rows import PREFILL_CHUNK_TOKENS

# A decode step's shapes in steps (see TorchDecoder._padded): at most 31 masked keys and 7 idle
# rows more, a small share of a step beside the weights every row's step reads.
SPAN_STEP, ROW_STEP = 32, 8


class TorchLogits(Logits):
    """(n, V) logits as the model computed them: a torch tensor in its dtype, on its device."""

    def argmax(self) -> list[int]:
        if self.values.device.type == "cpu" and self.values.dtype == torch.float32:
            # numpy's argmax on the tensor's own memory: a decode step of tiny at 8 rows spent
            # 16 us on torch's argmax op against 5 us here (one thread).
            return self.values.numpy().argmax(-1).tolist()
        return self.values.argmax(-1).tolist()

    def row(self, n: int) -> np.ndarray:
        return self.values[n].float().cpu().numpy()

    def take(self, order: list[int]) -> "TorchLogits":
        return TorchLogits(self.values[torch.tensor(order, device=self.values.device)])

    def join(self, others: list["TorchLogits"]) -> "TorchLogits":
        return TorchLogits(torch.cat([self.values, *(o.values for o in others)]))

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return self.values.float().cpu().numpy().astype(dtype or np.float32, copy=False)


class TorchDecoder(PrefixPrefill):
    """Batched prefill and decode over one KV cache of `slots` rows.

    `prefix_cache` and `chunk_tokens` switch the prefill's savings off (False; a chunk larger than
    any prefill), and `pack=False` starting rows inside a decode step, for the oracles that check them."""

    def __init__(self, model, slots: int, max_len: int, every_slot: bool | None = None, prefix_cache: bool = True,
                 chunk_tokens: int = PREFILL_CHUNK_TOKENS, pack: bool = True, numpy_step: bool = True):
        super().__init__(max_len, prefix_cache, chunk_tokens)
        self.model = model
        self.slots = slots
        self.cache = model.make_cache(slots, max_len)
        self.device = self.cache.k.device
        self.every_slot = self.device.type == "cuda" if every_slot is None else every_slot
        # A float32 CPU base's plain Llama-family stack decodes on numpy (numpy_step.py), where
        # a small model's step is op calls more than arithmetic.
        self.numpy_step = model.numpy_step(self.cache.k, self.cache.v) if numpy_step and not self.every_slot else None
        self.pack = pack
        self.host_lengths = np.zeros(slots, dtype=np.int64)  # each slot's cached tokens, as the device has them
        # The prefix cache's entry: its keys and values, (layers, kv_heads, max_len, head_dim) each,
        # allocated once (the memory plan counts one prompt of max_len tokens).
        entry = (self.cache.k.shape[0], *self.cache.k.shape[2:])
        self.prefix_k = zeros(entry, self.cache.k.dtype, self.device) if prefix_cache else None
        self.prefix_v = zeros(entry, self.cache.v.dtype, self.device) if prefix_cache else None

    def _adapt(self, slots: list[int], counts) -> None:
        """Many adapters (multi_lora.py): each token of the next forward's adapter, `counts` tokens per slot in order."""
        ids = self._token_adapters(slots, counts)
        if ids is not None and getattr(self.model, "adapter_rows", None) is not None:
            self.model.adapter_rows.set(ids)

    @staticmethod
    def _host(logits: torch.Tensor) -> TorchLogits:
        return TorchLogits(logits)

    @torch.inference_mode()
    def prefill(self, slots: list[int], prompts: list[list[int]]) -> TorchLogits:
        """Start each prompt in its slot (the slot's old keys are dropped); (n, V) logits at each prompt's end."""
        return super().prefill(slots, prompts)

    def _from_entry(self, slot: int, n: int) -> None:
        self.cache.k[:, slot, :, :n] = self.prefix_k[:, :, :n]
        self.cache.v[:, slot, :, :n] = self.prefix_v[:, :, :n]

    def _to_entry(self, slot: int, n: int) -> None:
        self.prefix_k[:, :, :n] = self.cache.k[:, slot, :, :n]
        self.prefix_v[:, :, :n] = self.cache.v[:, slot, :, :n]

    def _forward(self, slots: list[int], pieces: list[list[int]], offsets: list[int], width: int) -> torch.Tensor:
        """The pieces right-padded into one forward, appended after each slot's `offsets` cached tokens; (n, width, D)."""
        ids = torch.tensor([p + [0] * (width - len(p)) for p in pieces], device=self.device)  # (n, width)
        self._adapt(slots, width)
        view = self.cache.view(slots)
        view.next_span = max(offsets) + width
        return self.model.hidden_states(ids, cache=view)

    def _logits(self, hidden: torch.Tensor, rows: list[int], positions: list[int]) -> TorchLogits:
        at = torch.tensor([rows, positions], device=self.device)
        return self._host(self.model.logits(hidden[at[0], at[1]]))

    def _set_lengths(self, slots: list[int], lengths: list[int]) -> None:
        self.cache.lengths[torch.tensor(slots, device=self.device)] = torch.tensor(lengths, device=self.device)
        self.host_lengths[slots] = lengths

    @torch.inference_mode()
    def decode(self, slots: list[int], last: list[int]) -> TorchLogits:
        """One token for each of `slots` (its last token given); (n, V) logits."""
        if self.every_slot:
            return self._decode_every_slot(slots, last)
        if self.numpy_step is not None:
            self._adapt(slots, 1)
            logits = self.numpy_step.decode(slots, last, self.host_lengths[slots])
            self._set_lengths(slots, (self.host_lengths[slots] + 1).tolist())
            return self._host(logits)
        n = len(slots)
        rows = self._padded(slots)
        self._adapt(rows, 1)
        view = self.cache.view(rows)
        view.next_span = self._span(int(self.host_lengths[slots].max()) + 1)
        logits = self.model(torch.tensor(last + [0] * (len(rows) - n), device=self.device)[:, None], cache=view)[:, -1]
        if view.index is not None:
            self.cache.lengths[view.index] = view.lengths
        if len(rows) > n:  # the pad rows' throwaway token is forgotten: idle slots hold nothing
            self.cache.lengths[rows[n:]] = 0
        self.host_lengths[slots] += 1
        return self._host(logits[:n])

    def packs(self, prompts: list[list[int]], decoding: int) -> bool:
        """Whether these prompts may start inside the next decode step of `decoding` rows
        (decode_and_prefill): on a CPU's float32 base, up to one chunk of tokens in all. Elsewhere
        the step's token count, which varies with every prompt, would be a new GEMM shape each
        time: a bfloat16 base's oneDNN primitives are kept per shape (memory), and a GPU decodes
        every slot in place."""
        return (self.pack and not self.every_slot and self.cache.k.dtype == torch.float32
                and sum(map(len, prompts)) + decoding <= self.chunk_tokens)

    @torch.inference_mode()
    def decode_and_prefill(self, slots: list[int], last: list[int], new_slots: list[int],
                           prompts: list[list[int]]) -> tuple[TorchLogits, TorchLogits]:
        """decode(slots, last) and prefill(new_slots, prompts) as one forward of their tokens packed
        end to end (the model's PackedStep); (n, V) decode logits and (m, V) prefill logits. With
        no slots decoding, a prefill without padding."""
        self._share_group_prefix(new_slots, prompts)
        starts = [self._reuse(s, p) for s, p in zip(new_slots, prompts)]
        lengths = self.host_lengths[slots].tolist()
        pieces = [p[start:] for p, start in zip(prompts, starts)]
        tokens = last + [t for p in pieces for t in p]
        self._adapt(slots + new_slots, [1] * len(slots) + list(map(len, pieces)))
        if self.numpy_step is not None:
            logits = self._host(self.numpy_step.step(tokens, slots, lengths, list(zip(new_slots, starts, map(len, pieces)))))
        else:
            step = PackedStep(self.cache, slots, lengths, new_slots, starts, list(map(len, pieces)),
                              self._span(max(lengths, default=0) + 1))
            hidden = self.model.hidden_states(torch.tensor(tokens, device=self.device)[None], cache=step)[0]  # (N, D)
            ends = list(range(len(slots))) + [at + n - 1 for _, _, n, at in step.parts]
            logits = self._host(self.model.logits(hidden[torch.tensor(ends, device=self.device)]))
        self._set_lengths(slots + new_slots, [n + 1 for n in lengths] + [len(p) for p in prompts])
        self._remember(new_slots[0], prompts[0])
        return logits[: len(slots)], logits[len(slots):]

    # On a bfloat16 (or float16) base a CPU's matmuls are oneDNN primitives, made and kept per
    # shape: the process grew about 1 MB with every new key span and 2-4 MB with every new row
    # count (SmolLM2-135M, 32 slots draining to 9: 621 -> 731 MB; spans in steps of 32 and rows
    # in steps of 8: flat). So there a decode step's shapes come in steps: masked keys past the
    # longest row, and idle slots computing a throwaway token. A float32 base's kernels keep
    # nothing per shape, and its steps stay exact in size.

    def _span(self, keys: int) -> int:
        """The keys a decode step attends: rounded up to SPAN_STEP where shapes cost memory."""
        if self.cache.k.dtype == torch.float32:
            return keys
        return min(self.max_len, -(-keys // SPAN_STEP) * SPAN_STEP)

    def _padded(self, slots: list[int]) -> list[int]:
        """`slots`, then idle slots up to a multiple of ROW_STEP where shapes cost memory."""
        want = min(self.slots, -(-len(slots) // ROW_STEP) * ROW_STEP)
        if self.cache.k.dtype == torch.float32 or want == len(slots):
            return slots
        running = set(slots)
        return slots + [i for i in range(self.slots) if i not in running][: want - len(slots)]

    def _decode_every_slot(self, slots: list[int], last: list[int]) -> TorchLogits:
        packed = np.zeros((3, self.slots), dtype=np.int64)  # token ids, running (0/1), output order
        self._adapt(list(range(self.slots)), 1)
        packed[0, slots], packed[1, slots], packed[2, : len(slots)] = last, 1, slots
        packed = torch.from_numpy(packed).to(self.device, non_blocking=True)
        self.cache.next_span = int(self.host_lengths[slots].max()) + 1
        logits = self.model(packed[0][:, None], cache=self.cache)[:, -1]  # (slots, V)
        # Idle slots hold nothing (released, length 0): their throwaway token is forgotten.
        self.cache.lengths.mul_(packed[1])
        self.host_lengths[slots] += 1
        return self._host(logits[packed[2, : len(slots)]])

    def release(self, slot: int) -> None:
        self.cache.lengths[slot] = 0
        self.host_lengths[slot] = 0
