"""Training examples from JSONL (runtime/data/jsonl.py reads it), and the training batch order.

The order is a pure function of (seed, epoch, step) over the tokenized examples, so a
job resumed on another machine or engine sees exactly the batches it would have seen.
"""

import math
from dataclasses import dataclass

import numpy as np

from runtime.data.messages import normalize, weight_problem
from runtime.base.errors import SpillpackError, UsageError
from runtime.base.fileio import sha256_bytes
from runtime.data.jsonl import MAX_NESTING, iter_jsonl, nesting_past, read_bytes
from runtime.models.tokenizer import is_trained

STEPS_MAX = 2**63 - 1  # the step count a state's records hold (runtime.config.options.INT_MAX)

# -- training examples --------------------------------------------------------------


def chat_messages(obj: dict, n: int, uri: str) -> list[dict]:
    """The OpenAI fine-tuning chat shape, or {prompt, completion} as one user/assistant turn."""
    if "messages" in obj:
        messages, problem = normalize(obj["messages"])
        problem = problem or weight_problem(messages)
        if problem:
            raise SpillpackError(f"{uri} line {n}: {problem}", f"sed -n {n}p {uri}")
        if not any(is_trained(m) and m["content"] for m in messages):
            raise SpillpackError(f"{uri} line {n} has no assistant content to learn from", f"sed -n {n}p {uri}")
        return messages
    if "prompt" in obj and "completion" in obj:
        if not isinstance(obj["completion"], str) or not obj["completion"]:
            raise SpillpackError(f"{uri} line {n} has an empty completion", f"sed -n {n}p {uri}")
        if not isinstance(obj["prompt"], str):
            raise SpillpackError(f"{uri} line {n}: \"prompt\" must be a string", f"sed -n {n}p {uri}")
        return [{"role": "user", "content": obj["prompt"]}, {"role": "assistant", "content": obj["completion"]}]
    raise SpillpackError(f"{uri} line {n} has neither \"messages\" nor \"prompt\"/\"completion\"", f"sed -n {n}p {uri}")


@dataclass
class Example:
    ids: list[int]
    mask: list[int]  # 1 where the token is a target (assistant content and its end-of-turn)


@dataclass
class TrainData:
    examples: list[Example]
    dropped_long: int
    sha256: str


def train_conversations(raw: bytes, uri: str) -> list[tuple[int, list[dict]]]:
    """(line number, messages) of every example: the checks that need no tokenizer, which
    `spillpack pack` runs too."""
    out = []
    for n, obj in iter_jsonl(raw, uri):
        if nesting_past(obj):
            raise SpillpackError(f"{uri} line {n} nests objects and lists more than {MAX_NESTING} deep; a conversation nests a few",
                                 f"sed -n {n}p {uri} | head -c 300")
        out.append((n, chat_messages(obj, n, uri)))
    return out


def load_train_data(uri: str, tokenizer, max_seq: int, bundle=None, select=None, what: str = "training data") -> TrainData:
    """`select(line bytes) -> bool`: only the rows it keeps (a validation split, runtime/data/validation.py)."""
    raw = read_bytes(uri, what, bundle)
    lines = raw.splitlines() if select is not None else None
    examples, dropped = [], 0
    for n, messages in train_conversations(raw, uri):
        if select is not None and not select(lines[n - 1]):
            continue
        ids, mask = tokenizer.encode_chat(messages)
        if len(ids) > max_seq:
            dropped += 1
            continue
        if sum(mask[1:]) == 0:  # targets are predicted from the token before them
            raise SpillpackError(f"{uri} line {n} has no assistant tokens after rendering", f"sed -n {n}p {uri}")
        examples.append(Example(ids, mask))
    if not examples and select is not None and not dropped:
        raise SpillpackError(f"no row of {uri} falls in this part of the validation split", "a larger file or another --val-fraction")
    if not examples:
        raise SpillpackError(f"every example in {uri} is longer than --max-seq {max_seq} ({dropped} dropped)", f"--max-seq {max_seq * 2}")
    return TrainData(examples, dropped, sha256_bytes(raw))


# -- batch order ----------------------------------------------------------------------


def epoch_batches(lengths: list[int], batch: int, seed: int, epoch: int) -> list[list[int]]:
    """One epoch's micro-batches (example indices), grouped by length so little is padding.

    Shuffle, sort within windows of 16 batches so each batch holds similar lengths, then
    shuffle the batches themselves. Pure function of its arguments.
    """
    rng = np.random.Generator(np.random.PCG64([seed, epoch]))
    order = rng.permutation(len(lengths))
    window = batch * 16
    batches = []
    for start in range(0, len(order), window):
        chunk = sorted(order[start:start + window].tolist(), key=lambda i: (lengths[i], i))
        batches.extend(chunk[i:i + batch] for i in range(0, len(chunk), batch))
    return [batches[i] for i in rng.permutation(len(batches)).tolist()]


class BatchOrder:
    """The examples of each optimizer step across epochs, and how a step is cut into micro-batches.

    The order groups examples by the effective batch (--batch x --grad-accum): step s takes
    group s of the run, a pure function of (seed, epoch, step). The micro-batch size only cuts
    a step's examples into consecutive pieces, so a step sees the same examples whether it runs
    4 x 1, 2 x 2 or 1 x 4: the micro-batch size is not part of the job, the effective batch is.
    """

    def __init__(self, lengths: list[int], batch: int, grad_accum: int, seed: int):
        self.lengths, self.batch, self.grad_accum, self.seed = lengths, batch, grad_accum, seed
        self.effective = batch * grad_accum
        self.per_epoch = math.ceil(len(lengths) / self.effective)  # steps per epoch
        self._cache: dict[int, list[list[int]]] = {}

    def steps_for(self, steps: int | None, epochs: float | None) -> int:
        if steps is not None:
            return steps
        want = (epochs or 1.0) * self.per_epoch
        if not want <= STEPS_MAX:  # inf too
            raise UsageError(f"--epochs {epochs:g} is {want:.3g} steps of {self.effective} examples, more than the {STEPS_MAX} "
                             "a job counts", "spillpack tune ... --epochs 1, or --steps N")
        return max(1, min(STEPS_MAX, math.ceil(want)))

    def step_examples(self, step: int) -> list[int]:
        epoch, i = divmod(step, self.per_epoch)
        if epoch not in self._cache:
            self._cache = {epoch: epoch_batches(self.lengths, self.effective, self.seed, epoch)}
        return self._cache[epoch][i]

    def micro_batches(self, step: int, size: int | None = None) -> list[list[int]]:
        """Step `step`'s examples, `size` (default --batch) at a time."""
        size = size or self.batch
        examples = self.step_examples(step)
        return [examples[i:i + size] for i in range(0, len(examples), size)]


def collate(examples: list[Example], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded (B, T) input ids and (B, T) next-token labels, -100 where no loss."""
    T = max(len(e.ids) for e in examples)
    ids = np.full((len(examples), T), pad_id, dtype=np.int64)
    labels = np.full((len(examples), T), -100, dtype=np.int64)
    for b, e in enumerate(examples):
        n = len(e.ids)
        ids[b, :n] = e.ids
        target = np.asarray(e.ids[1:], dtype=np.int64)
        keep = np.asarray(e.mask[1:], dtype=bool)
        labels[b, : n - 1] = np.where(keep, target, -100)
    return ids, labels


def rank_share(micro_batches: list[list[int]], rank: int, world: int) -> list[list[int]]:
    """The part of one optimizer step that rank `rank` of `world` computes.

    The step's rows, in order, are cut into `world` contiguous runs whose lengths differ by at
    most one row, whether or not the world size divides the micro-batches or their rows; each
    run keeps the micro-batch boundaries, so no rank ever forwards more rows at once than
    --batch, and a rank may get nothing (it adds zero gradient). The split only decides who
    computes what: the step's loss is a sum over all its target tokens divided by their total,
    so the ranks' gradients sum to the same step.
    """
    if world == 1:
        return micro_batches
    total = sum(len(mb) for mb in micro_batches)
    lo, hi = rank * total // world, (rank + 1) * total // world
    out, at = [], 0
    for mb in micro_batches:
        part = mb[max(0, lo - at):max(0, hi - at)]
        if part:
            out.append(part)
        at += len(mb)
    return out


def rank_rows(micro_batches: list[list[int]], rank: int, world: int) -> list[tuple[list[int], list[int]]]:
    """rank_share's micro-batches, each as (examples, their rows' places in the step). A row's
    place keys its LoRA dropout masks (runtime.models.dropout), so a step draws the same masks
    however it is cut into micro-batches or spread over ranks."""
    places, at = [], 0
    for mb in micro_batches:
        places.append(list(range(at, at + len(mb))))
        at += len(mb)
    flat = [i for mb in micro_batches for i in mb]
    return [([flat[r] for r in mb], mb) for mb in rank_share(places, rank, world)]
