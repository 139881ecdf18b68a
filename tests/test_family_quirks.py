"""What one family has and the others do not, held to transformers: Qwen3-MoE's router and
expert LoRA, Gemma 3's image-text checkpoints, Phi-3's fused targets and LongRoPE. The shared
tests every family goes through are in test_families.py."""

import json

import numpy as np
import pytest
import torch

from runtime.engines import OptimSpec

from runtime.engines.registry import get_engine
from runtime.engines.torch.models import load_model as torch_load
from runtime.models.lora import LoraSpec, init_tensors, save_adapter
from runtime.models.ref import resolve_model
from tests.support.hf_fixtures import make_family
from tests.test_families import TOL, family, hf_alone, lora_targets, prompts_of, random_lora  # noqa: F401 (family: fixture)

mx = pytest.importorskip("mlx.core")


def test_qwen3_moe_router_choices_match_transformers(family):
    md, hf = family("qwen3_moe")
    ids = torch.tensor(prompts_of([17, 17, 17], seed=4))
    theirs = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, out: theirs.append(out[2].sort(-1).values))
             for layer in hf.model.layers]
    try:
        with torch.no_grad():
            want = hf(input_ids=ids).logits
    finally:
        for h in hooks:
            h.remove()
    ours = torch_load(md)
    with torch.no_grad():
        got = ours(ids)
    mine = [layer.mlp.last_choices.sort(-1).values for layer in ours.model.layers]
    assert len(mine) == len(theirs) == 2 and all(torch.equal(a, b) for a, b in zip(mine, theirs))
    assert len({tuple(r) for r in mine[0].tolist()}) > 1  # tokens really go to different experts
    assert (got - want).abs().max().item() < TOL
    mlx_model = get_engine("mlx").load_model(md)
    np.testing.assert_allclose(np.array(mlx_model(mx.array(ids.numpy()))), want.numpy(), atol=TOL, rtol=0)
    mlx_choices = [np.sort(np.array(layer.mlp._last_choices), -1) for layer in mlx_model.model.layers]
    assert all(np.array_equal(a, b.numpy()) for a, b in zip(mlx_choices, theirs))


def test_moe_expert_lora_equals_its_merge_into_transformers_experts(family):
    """LoRA on Qwen3-MoE's experts (and attention): spillpack's adapted model gives the logits of
    transformers' model with B @ A * scale added to its expert tensors, on torch and MLX."""
    md, hf = family("qwen3_moe")
    assert lora_targets(md) == ("down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj")
    spec = LoraSpec(rank=4, alpha=8.0, targets=("q_proj", "gate_proj", "up_proj", "down_proj"))
    tensors = random_lora(md.config, spec)
    assert "model.layers.1.mlp.experts.3.down_proj.lora_B.weight" in tensors
    ids = torch.tensor(prompts_of([13, 13], seed=7))
    merged = {k: p.detach().clone() for k, p in hf.state_dict().items()}
    inter = md.config["moe_intermediate_size"]
    for name in {k.rsplit(".lora_", 1)[0] for k in tensors}:
        delta = spec.scale * torch.from_numpy(tensors[f"{name}.lora_B.weight"] @ tensors[f"{name}.lora_A.weight"])
        if ".experts." not in name:
            merged[f"{name}.weight"] += delta
            continue
        prefix, e, proj = name.rsplit(".", 2)[0], int(name.split(".")[-2]), name.split(".")[-1]  # (...mlp.experts, E, proj)
        if proj == "down_proj":
            merged[f"{prefix}.down_proj"][e] += delta
        else:  # transformers 5 fuses gate and up: gate rows first
            rows = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
            merged[f"{prefix}.gate_up_proj"][e, rows] += delta
    original = {k: p.detach().clone() for k, p in hf.state_dict().items()}
    hf.load_state_dict(merged)
    try:
        with torch.no_grad():
            want = hf(input_ids=ids).logits
    finally:
        hf.load_state_dict(original)
    with torch.no_grad():
        plain = hf(input_ids=ids).logits
    assert (plain - want).abs().max().item() > 1e-3  # the expert adapters really change the model
    with torch.no_grad():
        got = get_engine("torch-cpu").load_model(md, (tensors, spec))(ids)
    assert (got - want).abs().max().item() < TOL
    mlx_got = np.array(get_engine("mlx").load_model(md, (tensors, spec))(mx.array(ids.numpy())))
    np.testing.assert_allclose(mlx_got, want.numpy(), atol=TOL, rtol=0)


def test_gemma3_image_text_checkpoint_loads_its_language_model(tmp_path, tiny_home, monkeypatch):
    """gemma3:4b/12b/27b are Gemma3ForConditionalGeneration checkpoints: the language model
    loads from them (vision tower left out) and gives transformers' logits for text."""
    from tests.support.hf_fixtures import make_gemma3_image_text

    monkeypatch.setenv("SPILLPACK_HOME", str(tiny_home))
    path, hf = make_gemma3_image_text(tmp_path / "g3")
    md = resolve_model(str(path))
    assert md.arch == "gemma3" and md.config["num_hidden_layers"] == 3
    ids = prompts_of([15, 15], seed=5)
    with torch.no_grad():
        want = hf(input_ids=torch.tensor(ids)).logits.numpy()
    for engine in ("torch-cpu", "mlx"):
        model = get_engine(engine).load_model(md)
        got = model(torch.tensor(ids)).detach().numpy() if engine == "torch-cpu" else np.array(model(mx.array(ids)))
        np.testing.assert_allclose(got, want, atol=TOL, rtol=0, err_msg=engine)


def test_gemma3_image_text_merge_loads_back(tmp_path, tiny_home, monkeypatch):
    """`tune --merge` of an image-text Gemma 3 writes the language model under the text model's
    names; spillpack loads it back with the adapted model's logits."""
    from runtime.jobs.tune import write_merged
    from tests.support.hf_fixtures import make_gemma3_image_text

    monkeypatch.setenv("SPILLPACK_HOME", str(tiny_home))
    path, _ = make_gemma3_image_text(tmp_path / "g3")
    md = resolve_model(str(path))
    spec = LoraSpec(rank=4, alpha=8.0, targets=("q_proj", "down_proj"))
    session = get_engine("torch-cpu").train_session(md, spec, random_lora(md.config, spec), OptimSpec())
    write_merged(tmp_path / "merged", session, md)
    ids = torch.tensor(prompts_of([12, 12], seed=6))
    with torch.no_grad():
        want = session.model(ids)
        got = get_engine("torch-cpu").load_model(resolve_model(str(tmp_path / "merged")))(ids)
    assert (got - want).abs().max().item() < TOL


def test_phi3_takes_the_unfused_target_names(family, tmp_path):
    """The same --targets on every family: q,k,v (and gate,up) adapt Phi-3's fused linears, and
    the saved adapter names those for PEFT; a part of a fused linear alone is refused."""
    from runtime.base.errors import SpillpackError

    md, _ = family("phi3")
    spec = LoraSpec(4, 8.0, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    tensors = init_tensors(md.config, spec, 0)
    assert {k.split(".")[-3] for k in tensors} == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    save_adapter(tmp_path / "a", tensors, spec, str(md.path), md.config["num_hidden_layers"])
    assert json.loads((tmp_path / "a" / "adapter_config.json").read_text())["target_modules"] == [
        "down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
    with pytest.raises(SpillpackError) as e:
        init_tensors(md.config, LoraSpec(4, 8.0, ("q_proj", "v_proj")), 0)
    assert e.value.line() == ("spillpack: phi3 fuses q_proj, k_proj, v_proj into qkv_proj; --targets names only q_proj, "
                              "v_proj. Try: --targets with qkv_proj (or all of q_proj,k_proj,v_proj)")


def test_phi3_longrope_matches_transformers_below_and_past_the_original_context(tmp_path, tiny_home, monkeypatch):
    """Phi-3.5/Phi-4-mini's LongRoPE (short and long factors, cos/sin scaled by the attention
    factor) with partial rotary: a forward within the original context and one past it."""
    monkeypatch.setenv("SPILLPACK_HOME", str(tiny_home))
    rotary = int(16 * 0.75) // 2  # factors per rotary frequency
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "short_factor": [1.0 + 0.1 * i for i in range(rotary)], "long_factor": [2.0 + 0.5 * i for i in range(rotary)]}
    path, hf = make_family("phi3", tmp_path / "phi", max_position_embeddings=64, original_max_position_embeddings=16,
                           rope_parameters=rope)
    md = resolve_model(str(path))
    torch_model, mlx_model = torch_load(md), get_engine("mlx").load_model(md)
    for n in (12, 24):  # 24 > 16: the long factors
        ids = prompts_of([n], seed=n)
        want = hf_alone(hf, ids[0])
        with torch.no_grad():
            np.testing.assert_allclose(torch_model(torch.tensor(ids))[0].numpy(), want, atol=TOL, rtol=0, err_msg=f"torch {n}")
        np.testing.assert_allclose(np.array(mlx_model(mx.array(ids)))[0], want, atol=TOL, rtol=0, err_msg=f"mlx {n}")
