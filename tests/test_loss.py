"""The tune's loss, computed in the logits' own buffer (runtime/engines/torch/loss.py:
cross_entropy_in_place and target_loss), held to torch's F.cross_entropy and its autograd."""

import pytest
import torch
import torch.nn.functional as F

from runtime.engines.torch.loss import cross_entropy_in_place, target_loss


def logits_and_targets(n=37, vocab=1003, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=g) * 4  # spread wide enough that the max matters
    logits[3, 11] = 60.0  # one near-certain position: exp(x - max) must not overflow
    return logits, torch.randint(0, vocab, (n,), generator=g)


def test_the_loss_and_its_gradient_equal_cross_entropy_and_autograd():
    logits, targets = logits_and_targets()
    x = logits.clone().requires_grad_(True)
    expected = F.cross_entropy(x, targets, reduction="sum")
    scale = torch.tensor(0.125)
    expected.backward(scale)

    buffer = logits.clone()
    loss = cross_entropy_in_place(buffer, targets, scale)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    # The buffer now holds the gradient wrt the logits, at the scale asked for.
    torch.testing.assert_close(buffer, x.grad, rtol=0, atol=1e-7)
    assert buffer[3].sum().abs().item() < 1e-6  # softmax - one-hot sums to zero per row

    without = logits.clone()
    assert cross_entropy_in_place(without, targets).item() == pytest.approx(expected.item(), rel=1e-6)


class Head(torch.nn.Module):
    """A model's `logits` as target_loss calls it: a frozen linear head in the base dtype."""

    def __init__(self, d, vocab, dtype):
        super().__init__()
        self.weight = torch.randn(vocab, d, generator=torch.Generator().manual_seed(1)).to(dtype) * 0.1

    def logits(self, hidden):
        return F.linear(hidden.to(self.weight.dtype), self.weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [10**9, 7])
def test_target_loss_gives_the_hidden_states_the_gradient_autograd_gives(dtype, chunk):
    """Chunked or whole, on a float32 or bfloat16 head: the loss and the gradient reaching the
    hidden states equal those of cross_entropy through autograd (the reference rounds the
    bfloat16 head's output to float32 the same way)."""
    model = Head(64, 1003, dtype)
    hidden = torch.randn(50, 64, generator=torch.Generator().manual_seed(2))
    targets = torch.randint(0, 1003, (50,), generator=torch.Generator().manual_seed(3))
    g = 1 / 50

    h1 = hidden.clone().requires_grad_(True)
    expected = F.cross_entropy(model.logits(h1).float(), targets, reduction="sum")
    (expected * g).backward()

    h2 = hidden.clone().requires_grad_(True)
    loss = target_loss(model, h2, targets, chunk, g)
    (loss * g).backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    tol = 1e-6 if dtype == torch.float32 else 2e-3 * h1.grad.abs().max().item()
    torch.testing.assert_close(h2.grad, h1.grad, rtol=0, atol=tol)
    assert h1.grad.abs().max() > 0
