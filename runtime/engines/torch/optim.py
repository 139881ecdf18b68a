"""AdamW over the LoRA tensors: torch's own update (`torch.optim.adam.adam`, the function that
`torch.optim.AdamW.step` calls, with the same arguments), without the `torch.optim.Optimizer`
object around it. That object's first call imports torch._dynamo, for a compiler a tune never
uses: a 3-step tune on tiny from a cold process took 2.8-3.9 s with it, 2.2-2.6 s without
(2-core AMD EPYC, alternating).

The state is what torch.optim.AdamW keeps per parameter: `step` (a float32 scalar on the CPU),
`exp_avg` and `exp_avg_sq` beside the parameter; the engine makes it, saves it and loads it.
"""

from __future__ import annotations

import torch
from torch.optim.adam import adam


class AdamW:
    def __init__(self, params: list[torch.Tensor], betas: tuple[float, float], eps: float, weight_decay: float):
        self.params, self.betas, self.eps, self.weight_decay = params, betas, eps, weight_decay
        self.lr = 0.0
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}

    @torch.no_grad()
    def step(self) -> None:
        """One update of every parameter with a gradient, as AdamW.step would make it: the same
        kernels (foreach and fused left to torch's per-device default), so the same bits."""
        params = [p for p in self.params if p.grad is not None]
        if not params:
            return
        states = [self.state[p] for p in params]
        adam(params, [p.grad for p in params], [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], [],
             [s["step"] for s in states], foreach=None, capturable=False, differentiable=False, fused=None,
             grad_scale=None, found_inf=None, has_complex=False, decoupled_weight_decay=True, amsgrad=False,
             beta1=self.betas[0], beta2=self.betas[1], lr=self.lr, weight_decay=self.weight_decay, eps=self.eps,
             maximize=False)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
