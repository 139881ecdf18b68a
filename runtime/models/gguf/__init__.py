"""GGUF files (llama.cpp, Ollama, LM Studio) as a model: one file holds the config (the
architecture's metadata keys), the tokenizer (tokenizer.ggml.*), the chat template and the
weights, quantized or not.

reader.py parses the header with every count and length checked against the file's size;
config.py maps an architecture's keys to the config dict spillpack's ModelArgs read;
tensors.py names, dequantizes (with the `gguf` package) and un-permutes the tensors;
tokenizer.py builds the `tokenizers` tokenizer the metadata describes. Framework-neutral
(numpy only), like the rest of runtime/models.
"""

SUFFIX = ".gguf"


def is_gguf_file(path) -> bool:
    """A .gguf file, or a file that starts with GGUF's magic: an Ollama blob is named by its digest
    (blobs/sha256-<hex>), with no suffix. Standard library only, cheap: callers ask of every model path."""
    from pathlib import Path

    path = Path(path)
    if not path.is_file():
        return False
    if path.suffix.lower() == SUFFIX:
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False
