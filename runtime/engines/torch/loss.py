"""The tune's loss over the positions with loss: cross-entropy a chunk of positions at a time
(runtime.models.memory.loss_chunk), each chunk's vocabulary-wide logits alive only while its
loss and their gradient are taken, in their own buffer."""

from __future__ import annotations

import torch


class _TargetLoss(torch.autograd.Function):
    """The summed loss whose input gradient is computed in forward, a chunk of positions at a
    time: each chunk's vocabulary-wide logits live only while its loss and gradient are taken
    (the head is frozen: only the hidden states need a gradient), so nothing is recomputed in
    backward and no chunk's logits outlive it. The gradient is taken at the grad_output the
    caller will pass (`grad_scale`), so backward hands over exactly what autograd would have
    computed through a checkpointed chunk."""

    @staticmethod
    def forward(ctx, hidden, targets, head, chunk: int, grad_scale: torch.Tensor):
        total, grads = None, []
        for s in range(0, hidden.shape[0], chunk):
            with torch.enable_grad():
                h = hidden[s:s + chunk].detach().requires_grad_(True)
                out = head(h)  # (n, V) in the head's dtype
            logits = out.detach().float()  # the same buffer on a float32 base
            loss = cross_entropy_in_place(logits, targets[s:s + chunk], grad_scale)  # logits now hold the gradient
            (g,) = torch.autograd.grad(out, h, logits.to(out.dtype))  # the head's backward reads its weight, not `out`
            del out, logits
            grads.append(g)
            total = loss if total is None else total + loss
        ctx.save_for_backward(torch.cat(grads) if len(grads) > 1 else grads[0], grad_scale)
        return total

    @staticmethod
    def backward(ctx, grad_output):
        grad, grad_scale = ctx.saved_tensors
        if not torch.equal(grad_output, grad_scale):  # not the backward forward prepared for: rescale
            grad = grad * (grad_output / grad_scale).to(grad.dtype)
        return grad, None, None, None, None


def cross_entropy_in_place(logits: torch.Tensor, targets: torch.Tensor, grad_scale: torch.Tensor | None = None) -> torch.Tensor:
    """F.cross_entropy(logits, targets, reduction="sum") of float32 (n, V) logits, computed in their
    own buffer; with `grad_scale` the buffer then holds the loss's gradient wrt the logits at that
    scale, (softmax - one-hot) * grad_scale. One n x V buffer where cross_entropy and its autograd
    keep four (the logits, the log-softmax and the gradients of both), so a chunk of the loss can
    cover 4x the positions in the same memory. The same arithmetic as log_softmax: the loss is
    max + log(sum(exp(x - max))) - x[target]."""
    picked = logits.gather(1, targets[:, None]).squeeze(1)
    top = logits.amax(-1, keepdim=True)
    exps = logits.sub_(top).exp_()
    sums = exps.sum(-1, keepdim=True)
    loss = (top + sums.log()).squeeze(1).sub_(picked).sum()
    if grad_scale is not None:
        grad = exps.div_(sums)  # softmax
        grad[torch.arange(len(targets), device=grad.device), targets] -= 1
        grad.mul_(grad_scale)
    return loss


def target_loss(model, hidden: torch.Tensor, targets: torch.Tensor, chunk: int, grad_scale: float = 1.0) -> torch.Tensor:
    """Summed cross-entropy of the positions with loss, hidden (N, D) and targets (N,), float32,
    `chunk` positions at a time (runtime.models.memory.loss_chunk). `grad_scale`: the gradient
    the caller's backward will bring to this loss (the step's 1/targets, times a loss scale)."""
    if not (torch.is_grad_enabled() and hidden.requires_grad):
        return sum(cross_entropy_in_place(model.logits(hidden[s:s + chunk]).float(), targets[s:s + chunk])
                   for s in range(0, hidden.shape[0], chunk))
    scale = torch.tensor(grad_scale, dtype=torch.float32, device=hidden.device)
    return _TargetLoss.apply(hidden, targets, model.logits, chunk, scale)
