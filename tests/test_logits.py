"""runtime/engines/logits.py: a step's logits stay where the engine made them; the generator takes
the greedy argmax there and copies out only the rows that sample or carry options."""

import numpy as np
import pytest
import torch

from runtime.engines.generation import Generator, Request
from runtime.engines.logits import Logits, as_logits
from runtime.engines.torch.decode import TorchLogits


def tied(dtype, seed=0):
    """(8, 4096) logits full of ties (values rounded to integers), in `dtype`."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(8, 4096, generator=g) * 2).round().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_torch_argmax_is_numpys_first_maximum_in_every_dtype(dtype):
    for seed in range(20):
        x = tied(dtype, seed)
        assert TorchLogits(x).argmax() == x.float().numpy().argmax(-1).tolist()


def test_rows_take_join_and_asarray_agree_for_numpy_and_torch():
    x = tied(torch.bfloat16)
    ours, theirs = TorchLogits(x), Logits(x.float().numpy())
    for a in (ours, theirs):
        assert a.shape == (8, 4096) and len(a) == 8
        np.testing.assert_array_equal(np.asarray(a), x.float().numpy())
        assert a.row(3).dtype == np.float32
        np.testing.assert_array_equal(a.row(3), x[3].float().numpy())
        np.testing.assert_array_equal(np.asarray(a[2:5]), x[2:5].float().numpy())
        np.testing.assert_array_equal(np.asarray(a.take([4, 0, 7])), x[[4, 0, 7]].float().numpy())
        np.testing.assert_array_equal(np.asarray(a[:3].join([a[5:], a[3:5]])), x[[0, 1, 2, 5, 6, 7, 3, 4]].float().numpy())
    assert as_logits(theirs) is theirs
    assert isinstance(as_logits(x.float().numpy()), Logits)


class Counting(TorchLogits):
    copied = 0

    def row(self, n):
        Counting.copied += 1
        return super().row(n)


def test_greedy_rows_copy_no_logits_out_and_sampled_rows_get_the_same_tokens(home):
    """Plain greedy rows never copy a row out (the argmax ran on the tensor); a run of greedy and
    sampled rows gives the tokens a decoder handing over numpy float32 arrays gives."""
    from runtime.engines.registry import get_engine
    from runtime.models.ref import resolve_model
    from runtime.models.tiny import ensure_tiny
    from runtime.models.tokenizer import Tokenizer

    model_dir = resolve_model(str(ensure_tiny()))
    tok = Tokenizer.from_dir(model_dir.path)
    model = get_engine("torch-cpu", "float32").load_model(model_dir)
    prompts = [tok.encode(t) for t in ("the cat sat", "a dog ran far away", "one two three four five six")]

    def run(wrap, temperature):
        dec = model.make_decoder(2, 64)
        dec._host = wrap
        gen = Generator(dec, tok)
        gen.eos = frozenset()
        for i, p in enumerate(prompts):
            gen.add(Request(str(i), p, 12, temperature=temperature, seed=3))
        out = {}
        while gen.active:
            out.update({r.key: r.tokens for r in gen.step()})
        return out

    Counting.copied = 0
    greedy = run(Counting, 0.0)
    assert Counting.copied == 0
    assert greedy == run(lambda t: t.float().numpy(), 0.0)
    sampled = run(Counting, 0.8)
    assert Counting.copied == 3 * 12  # one row a token
    assert sampled == run(lambda t: t.float().numpy(), 0.8)
