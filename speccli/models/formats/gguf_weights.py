"""A GGUF file's tensors, dequantized into a transformers state dict, fast.

For architectures its new GGUF loader does not cover (Qwen2, Llama, Mistral, ...), transformers
parses the file with the `gguf` package's reader (slow, see ``gguf_file``) and dequantizes every
block with the package's numpy code on one core. This reads the header with ``gguf_file``,
dequantizes each tensor with transformers' torch kernels (every core) where they cover the
block type (Q5_0 and Q5_1, which Q4_K_M files use and transformers lacks, are written here the
same way) and with the `gguf` package's numpy code for the rest, then names
and reshapes it with transformers' own GGUF tensor processors. The result is the state dict
transformers' path loads, bit for bit (tests/test_gguf_weights.py compares them).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import mmap
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, cast

import gguf
import numpy as np
import torch

from speccli.models.formats.gguf_config import config_dict
from speccli.models.formats.gguf_file import GgufHeader, GgufTensor, read_header

if TYPE_CHECKING:
    from transformers import PreTrainedModel

TensorProgress = Callable[[int, int], None]  # (tensors done, tensors in all)

_FLOAT_TYPES = {
    int(gguf.GGMLQuantizationType.F32): np.float32,
    int(gguf.GGMLQuantizationType.F16): np.float16,
}


def _q5_values(blocks: torch.Tensor, high_bits_at: int) -> torch.Tensor:
    """The 32 five-bit values of each Q5 block, as the gguf package unpacks them: element j < 16
    is the low nibble of byte j, element j + 16 its high nibble; bit j of the little-endian
    32-bit word at ``high_bits_at`` is element j's fifth bit. In uint8 throughout (4x less
    memory traffic than int32 on a large tensor)."""
    high_bytes = blocks[:, high_bits_at : high_bits_at + 4]
    fifth = ((high_bytes.unsqueeze(-1) >> _BIT_SHIFTS) & 1).reshape(-1, 32)
    nibbles = blocks[:, high_bits_at + 4 :]
    return torch.cat([nibbles & 0x0F, nibbles >> 4], dim=1) | (fifth << 4)


_BIT_SHIFTS = torch.arange(8, dtype=torch.uint8)


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    return blocks[:, start : start + 2].contiguous().view(torch.float16).to(torch.float32)


def _dequantize_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    return _half(blocks, 0) * (_q5_values(blocks, 2).to(torch.float32) - 16)


def _dequantize_q5_1(blocks: torch.Tensor) -> torch.Tensor:
    return _half(blocks, 0) * _q5_values(blocks, 4).to(torch.float32) + _half(blocks, 2)


_OWN_KERNELS = {
    int(gguf.GGMLQuantizationType.Q5_0): _dequantize_q5_0,
    int(gguf.GGMLQuantizationType.Q5_1): _dequantize_q5_1,
}


def _torch_kernel_types() -> set[int]:
    try:
        from transformers.integrations.gguf.dequant import GGML_BLOCK
    except ImportError:  # an older transformers: numpy for its types
        return set(_OWN_KERNELS)
    return set(GGML_BLOCK) | set(_OWN_KERNELS)


def dequantize(data: mmap.mmap, tensor: GgufTensor, torch_types: set[int]) -> np.ndarray:
    """``tensor``'s values in float32, shaped as in torch, in memory of their own (no view of
    the mapping)."""
    if tensor.ggml_type in torch_types:
        raw = torch.frombuffer(data, dtype=torch.uint8, count=tensor.nbytes, offset=tensor.start)
        if tensor.ggml_type in _OWN_KERNELS:
            _, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(tensor.ggml_type)]
            values = _OWN_KERNELS[tensor.ggml_type](raw.reshape(-1, block_bytes))
        else:
            from transformers.integrations.gguf.dequant import dequantize as torch_dequantize

            values = torch_dequantize(raw, tensor.ggml_type, torch.float32)
        return values.reshape(tensor.shape).numpy()
    if tensor.ggml_type in _FLOAT_TYPES:
        floats = np.frombuffer(
            data, dtype=_FLOAT_TYPES[tensor.ggml_type], count=math.prod(tensor.shape), offset=tensor.start
        )
        return floats.reshape(tensor.shape).astype(np.float32)  # a copy, out of the mapping
    block_elements, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(tensor.ggml_type)]
    raw_shape = (*tensor.shape[:-1], tensor.shape[-1] // block_elements * block_bytes)
    blocks = np.frombuffer(data, dtype=np.uint8, count=tensor.nbytes, offset=tensor.start).reshape(raw_shape)
    return gguf.dequantize(blocks, gguf.GGMLQuantizationType(tensor.ggml_type))


def state_dict(
    header: GgufHeader,
    model: Any,
    dtype: torch.dtype,
    progress: TensorProgress | None = None,
) -> dict[str, torch.Tensor]:
    """``header``'s tensors under ``model``'s parameter names, in ``dtype``. ``model`` (on the
    meta device is enough) gives the names; its config the shapes the processors need."""
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    config = model.config.to_dict()
    processor = TENSOR_PROCESSORS.get(header.architecture, TensorProcessor)(config=config)
    with _name_maps_built_once():
        names = get_gguf_hf_weights_map(model, processor)
    parsed: dict[str, Any] = {"config": config, "tensors": {}}
    torch_types = _torch_kernel_types()
    # Copy-on-write mapping: writable for torch.frombuffer, and nothing is ever written.
    with open(header.path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY) as data:
        for done, tensor in enumerate(header.tensors, start=1):
            _convert(data, tensor, processor, names, parsed, dtype, torch_types)
            if progress is not None:
                progress(done, len(header.tensors))
    return parsed["tensors"]


@contextlib.contextmanager
def _name_maps_built_once():
    """transformers' get_gguf_hf_weights_map asks the `gguf` package for its tensor name map
    once per submodule (hundreds of times for a small model, seconds in all), which depends
    only on the architecture and the layer count: build each once while it runs."""
    real = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(real)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = real


def _convert(
    data: mmap.mmap,
    tensor: GgufTensor,
    processor: Any,
    names: dict[str, str],
    parsed: dict[str, Any],
    dtype: torch.dtype,
    torch_types: set[int],
) -> None:
    """One tensor into ``parsed["tensors"]`` (a function of its own so that no view of the
    mapping outlives it: the mapping could not be closed)."""
    result = processor.process(
        weights=dequantize(data, tensor, torch_types),
        name=tensor.name,
        tensor_key_mapping=names,
        parsed_parameters=parsed,
    )
    if result.name in names:
        parsed["tensors"][names[result.name]] = torch.from_numpy(np.ascontiguousarray(result.weights)).to(dtype)


_parse_lock = threading.Lock()


class _ConfigFirst(dict):
    """``load_gguf_checkpoint``'s result with only its config, built from the header (see
    gguf_config): transformers' callers read nothing else. Any other part, asked for with
    ``result[key]``, runs the full parse then."""

    def __init__(self, config: dict[str, Any], parse_all: Any) -> None:
        super().__init__(config=config)
        self.parse_all = parse_all

    def __missing__(self, key: str) -> Any:
        for name, value in self.parse_all().items():
            self.setdefault(name, value)
        if key not in self:
            raise KeyError(key)
        return self[key]


def share_metadata_parse() -> None:
    """Make transformers parse a GGUF file's metadata once per process instead of once for
    the tokenizer's conversion and again for the config (`load_gguf_checkpoint` without
    tensors, through the `gguf` package's reader: 7-11 s for a Qwen file on the 2-core CPUs),
    and for the architectures gguf_config covers, not at all: their config is built from the
    header. Kept by the file's path, size and modification time; every caller gets its own
    copy of the config it may change. Idempotent; nothing happens if transformers no longer
    has the function."""
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        return
    with _parse_lock:
        parse = getattr(gguf_utils, "load_gguf_checkpoint", None)
        if parse is None or getattr(parse, "_specgen_shared", False):
            return

        @functools.lru_cache(maxsize=4)
        def parsed(path: str, size: int, mtime_ns: int) -> dict[str, Any]:
            try:
                config = config_dict(read_header(path))
            except (OSError, ValueError):
                config = None  # the slow parse says what is wrong
            if config is not None:
                return _ConfigFirst(config, lambda: parse(path, return_tensors=False))
            return parse(path, return_tensors=False)

        @functools.wraps(parse)
        def shared(gguf_checkpoint_path, return_tensors=False, model_to_load=None, torch_dtype=None):
            if return_tensors:
                return parse(gguf_checkpoint_path, return_tensors, model_to_load, torch_dtype)
            stat = os.stat(gguf_checkpoint_path)
            result = parsed(os.path.realpath(gguf_checkpoint_path), stat.st_size, stat.st_mtime_ns)
            if isinstance(result, _ConfigFirst):
                return _ConfigFirst(copy.deepcopy(result["config"]), result.parse_all)
            return {**result, "config": copy.deepcopy(result["config"])}

        shared._specgen_shared = True  # type: ignore[attr-defined]
        gguf_utils.load_gguf_checkpoint = shared


def gguf_config(path: Path) -> Any:
    """transformers' config for the GGUF file at `path`, from its header (`share_metadata_parse`:
    the tokenizer's conversion may have parsed it already)."""
    from transformers import AutoConfig

    share_metadata_parse()
    return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)


def load_causal_lm(
    path: Path, dtype: torch.dtype, device_map: dict[str, Any] | None, progress: TensorProgress | None = None
) -> Any:
    """The model ``AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)``
    gives for the GGUF file at ``path``, with the same weights bit for bit, several times faster.
    None where transformers' own loader should run instead: an architecture its new GGUF loader
    covers, or a config with no causal-LM class. Raises GgufFormatError for a damaged file."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    header = read_header(path)
    try:
        from transformers.integrations.gguf import is_gguf_arch_supported
    except ImportError:
        pass
    else:
        if is_gguf_arch_supported(header.architecture):
            return None
    config = gguf_config(path)
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        return None
    # transformers types this mapping's values as the tokenizer mapping's (slow, fast) pairs;
    # the causal-LM mapping gives the model class itself.
    model_class = cast("type[PreTrainedModel]", MODEL_FOR_CAUSAL_LM_MAPPING[type(config)])
    with torch.device("meta"):
        skeleton = model_class(config)  # names and shapes only: no memory, no initialisation
    tensors = state_dict(header, skeleton, dtype, progress)
    return model_class.from_pretrained(None, config=config, state_dict=tensors, dtype=dtype, device_map=device_map)
