"""`tune --shard-base`: the frozen base split across the ranks of a tune with torch.distributed's
FSDP2 (`fully_shard` over a one-dimensional DeviceMesh of the job's process group).

Each rank builds the model on the meta device, shards it (each decoder layer a unit of its own;
the embedding, the final norm and an untied head the root's) and reads from the checkpoint only
its own rows of each tensor (FSDP2 cuts dimension 0 as torch.chunk does), so the base a rank
holds, and its peak while loading, divide by the world size. A layer's weights are gathered for
its forward and again for its backward, and freed after each.

The LoRA parameters are left out of the sharding (`ignored_params`): every rank holds them
whole, in float32, with their AdamW moments, and the data-parallel machinery sums their
gradients as it does for an unsharded base (distributed.ProcessGroup.sum_gradients). So a
checkpoint is the same file either way, and a job resumes sharded or not, at any world size.

A gather is a collective, so every rank runs as many forwards and backwards in a step: a rank
with fewer micro-batches of the step runs idle passes over one pad token, whose gradient is zero.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from runtime.base.heap import trim_heap
from runtime.engines.torch.distributed import collective
from runtime.engines.torch.engine import TorchTrainSession, apply_lora, freeze, step_loss
from runtime.engines.torch.models import converted_tensors, model_file
from runtime.engines.torch.models.layout import SEPARATE, base_linear
from runtime.models.arch import architecture
from runtime.models.weights import check_weights, tensor_shapes, weight_files


def rows_of(n: int, rank: int, world: int) -> tuple[int, int]:
    """The rows [lo, hi) of a dimension of `n` that FSDP2 gives `rank` of `world` (torch.chunk's cut)."""
    size = -(-n // world)
    lo = min(rank * size, n)
    return lo, min(lo + size, n)


class StepLoss(nn.Module):
    """The sharding's root: the model's forward and its loss in one call, so FSDP's hooks on the
    root (the weights outside the layers: the embedding, the final norm, the head) run around both."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids, labels, chunk: int, g: float):
        return step_loss(self.model, ids, labels, chunk, g)


class ShardedTrainSession(TorchTrainSession):
    splits_rows = False  # one forward at a time: each one's gathers are collectives, in the same order on every rank
    lockstep = True  # every rank runs as many passes a step (TuneWork pads a short share with idle ones)

    def __init__(self, engine, model_dir, spec, tensors, opt, seed, group):
        # Never with loss scaling (runtime.jobs.sizing.plan_shards): a rank that retried a step at a
        # smaller scale would gather alone.
        assert not engine.precision.loss_scaling
        self.group, self.rank, self.world = group, group.rank, group.world
        super().__init__(engine, model_dir, spec, tensors, opt, seed)

    def _build(self, model_dir, tensors: dict):
        engine, device = self.engine, self.engine.device
        arch = architecture(model_dir.config, str(model_dir.path / "config.json"))
        args = arch.args.from_dict(model_dir.config)
        with torch.device("meta"):
            model = model_file(arch).Model(args)
        files = weight_files(model_dir.path)
        shapes = tensor_shapes(files)
        # sanitize moves values between keys: applied to the names, it maps each model name to its checkpoint name
        source = arch.sanitize(args, {n: n for n in shapes})
        check_weights({k: tuple(v.shape) for k, v in model.state_dict().items()}, {k: shapes[v] for k, v in source.items()},
                      files, model_dir)
        freeze(model, engine)
        for m in model.modules():
            if getattr(m, "joined", ()):
                m.__dict__["joined_kernel"] = SEPARATE
        params = apply_lora(model, tensors, self.spec, device, self.keys)
        model.model.call_layers = True
        root = StepLoss(model)
        mesh = DeviceMesh.from_group(self.group.shard_group, device.type)
        lora = set(params.values())
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, ignored_params=lora)
        fully_shard(root, mesh=mesh, ignored_params=lora)
        root.to_empty(device=device)  # each rank's shards allocated; the LoRA tensors too, written again below
        target = {v: k for k, v in source.items()}
        with torch.no_grad():
            for name, rows in converted_tensors(files, engine.base_dtype, device,
                                                rows=lambda n, shape: rows_of(shape[0], self.rank, self.world) if n in target else (0, 0)):
                if name not in target:
                    continue
                path, _, attr = target[name].rpartition(".")
                local = getattr(base_linear(model.get_submodule(path)), attr).to_local()
                assert tuple(local.shape) == tuple(rows.shape), (name, tuple(local.shape), tuple(rows.shape))
                local.copy_(rows)
            for n, p in params.items():
                p.copy_(torch.from_numpy(tensors[n]).to(device))
        trim_heap()  # the rows read, each freed once copied into its shard: their pages back to the system
        self.root = root
        return model, params

    def _forward_loss(self, ids, labels, chunk: int, g: float):
        return self.root(ids, labels, chunk, g)

    def _accumulate(self, micro_batches, total_targets: int, step: int, scale: float):
        real = [mb for mb in micro_batches if mb is not None]
        result = super()._accumulate(real, total_targets, step, scale)
        for _ in range(len(micro_batches) - len(real)):
            self._idle()
        return result

    def _idle(self) -> None:
        """A forward and backward that gathers what a real pass does and adds zero to every gradient."""
        dev = self.engine.device
        ids = torch.full((1, 2), self.pad_id, dtype=torch.long, device=dev)
        labels = torch.tensor([[-100, self.pad_id]], dtype=torch.long, device=dev)
        (self._forward_loss(ids, labels, self.loss_chunk, 0.0) * 0.0).backward()

    forward_backward = collective(TorchTrainSession.forward_backward)

    @collective
    def evaluate(self, micro_batches):
        try:
            return super().evaluate(micro_batches)
        finally:
            self.root.reshard()  # no backward to free the root's gathered weights after a forward without grad
