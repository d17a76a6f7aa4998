"""A GGUF file's transformers config from its header alone, for the architectures whose config
transformers builds by renaming metadata keys and nothing else.

Transformers reads the config of a GGUF file it has no newer loader for through
``load_gguf_checkpoint(path, return_tensors=False)``, which parses every metadata array with
the `gguf` package's reader (7-11 s for a Qwen file on the 2-core CPUs), tokenizer included,
and does so again for the tokenizer's conversion. For these architectures that function's
config is: whether the file has its own output matrix, its renamed scalar keys
(``GGUF_CONFIG_MAPPING``), and the vocabulary's size where no key gives it; built here from
``gguf_file``'s header in a fraction of a second. tests/test_gguf_config.py compares the two.
Other architectures (renamed, special-cased, or needing an array's values) get None: the
caller parses them the slow way.
"""

from __future__ import annotations

from typing import Any, cast

from speccli.models.formats.gguf_file import GgufHeader

# Architectures load_gguf_checkpoint gives no special treatment (a llama file named "mistral"
# becomes a Mistral config: that one is refused below).
PLAIN_ARCHITECTURES = ("llama", "qwen2", "qwen3")


def config_dict(header: GgufHeader) -> dict[str, Any] | None:
    """``load_gguf_checkpoint(header.path, return_tensors=False)["config"]``, or None where
    this cannot build it."""
    try:
        from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING
    except ImportError:
        return None
    architecture = header.architecture
    name = header.metadata.get("general.name")
    if architecture not in PLAIN_ARCHITECTURES or (isinstance(name, str) and "mistral" in name):
        return None
    config: dict[str, Any] = {"tie_word_embeddings": all(t.name != "output.weight" for t in header.tensors)}
    for key, value in GGUF_CONFIG_DEFAULTS_MAPPING.get(architecture, {}).items():
        config.setdefault(key, value)
    # {section: {key: renamed key, or -1 for one dropped}}: inferred there as {str: object}
    renames = cast("dict[str, dict[str, Any]]", GGUF_CONFIG_MAPPING)
    for key, value in header.metadata.items():
        prefix, _, rest = key.partition(".")
        renamed = renames.get(prefix, {}).get(rest)
        if renamed is None or renamed == -1:
            continue
        if key in header.arrays:
            return None  # its values, not its length: the slow parse reads them
        config[renamed] = value
    if "vocab_size" not in config:
        if "tokenizer.ggml.tokens" not in header.arrays:
            return None
        config["vocab_size"] = header.metadata["tokenizer.ggml.tokens"]
    return config
