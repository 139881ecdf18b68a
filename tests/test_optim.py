"""The tune's AdamW (runtime/engines/torch/optim.py) against torch.optim.AdamW, its oracle."""

import subprocess
import sys

import pytest
import torch

from runtime.engines.torch.optim import AdamW

ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent


def fresh_state(p):
    return {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_updates_are_bit_identical_to_torch_optim_adamw(weight_decay):
    torch.manual_seed(0)
    ours = [torch.randn(16, 64, requires_grad=True), torch.randn(64, 16, requires_grad=True), torch.randn(8, requires_grad=True)]
    theirs = [p.detach().clone().requires_grad_(True) for p in ours]
    opt = AdamW(ours, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay)
    peer = torch.optim.AdamW(theirs, lr=0.0, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay)
    for p in ours:
        opt.state[p] = fresh_state(p)
    for step in range(6):
        grads = [torch.randn_like(p) for p in ours]
        if step == 3:
            grads[2] = None  # a parameter without a gradient this step is left alone, step count too
        for p, q, g in zip(ours, theirs, grads):
            p.grad = q.grad = None if g is None else g.clone()
        opt.lr = 1e-3 * (step + 1)
        for group in peer.param_groups:
            group["lr"] = 1e-3 * (step + 1)
        opt.step()
        peer.step()
        opt.zero_grad()
        peer.zero_grad(set_to_none=True)
    for p, q in zip(ours, theirs):
        assert torch.equal(p, q)
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][key], peer.state[q][key]), key
    assert all(p.grad is None for p in ours)
    assert float(opt.state[ours[2]]["step"]) == 5.0


def test_a_tune_step_does_not_import_torch_dynamo(tmp_path):
    """torch.optim's Optimizer imports torch._dynamo on its first call: 1.4 s of a tune's start."""
    code = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
import numpy as np
from runtime.engines import OptimSpec
from runtime.engines.registry import get_engine
from runtime.models.lora import LoraSpec, init_tensors
from runtime.models.ref import resolve_model
from runtime.models.tiny import ensure_tiny
model = resolve_model(str(ensure_tiny()))
spec = LoraSpec(rank=4, alpha=8.0, targets=("q_proj", "v_proj"))
session = get_engine("torch-cpu", "float32", training=True).train_session(model, spec, init_tensors(model.config, spec, 0), OptimSpec())
ids = np.arange(1, 17, dtype=np.int64).reshape(2, 8) % 500
session.forward_backward([(ids, ids.copy())], total_targets=int(ids.size))
session.apply(1e-3)
print("torch._dynamo" in sys.modules)
"""
    env = {"PATH": "/usr/bin:/bin", "SPILLPACK_HOME": str(tmp_path), "SPILLPACK_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False"
