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
