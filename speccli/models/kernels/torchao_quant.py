"""torchao's weight-only quantizations on CUDA: `--quant int4` and `--quant fp8`.

At batch size 1 a pass reads every weight once, so fewer bytes per weight is speed, as long as
the kernel that reads them is fast: bitsandbytes NF4 reads a third of bf16's bytes but decodes
no faster on an H200 (BENCHMARKS.md, "GPU"), while torchao's int4 weight-only matmul (the
tinygemm kernel PyTorch ships, weights in groups of 128 with a scale and zero each) is the
path gpt-fast and torchao publish at about twice bf16's tokens/s. FP8 weight-only (8 bits, no
zero points) needs FP8 units: compute capability 8.9 (Ada) or later.

transformers applies the configuration while it places the weights (`TorchAoConfig`), so a
model is never on the GPU whole in bf16. The output layer and embeddings stay in the model's
dtype (transformers' default). Which of these `--quant auto` takes on CUDA is decided by
measurement (scripts/gpu_check.py); until one says otherwise it stays bitsandbytes NF4.
"""

from __future__ import annotations

import functools

import torch

from speccli.models.errors import ModelLoadError

TORCHAO_QUANTS = ("int4", "fp8")
INSTALL_HINT = 'pip install "specgen[cuda]" (torchao 0.18, for torch 2.11 or later)'
INT4_GROUP_SIZE = 128
FP8_CAPABILITY = (8, 9)


@functools.lru_cache(maxsize=None)
def torchao_problem() -> str | None:
    """None when torchao imports with the configurations used here, else why not."""
    try:
        from torchao.quantization import Float8WeightOnlyConfig, Int4WeightOnlyConfig  # noqa: F401
    except Exception as exc:  # ImportError, or a torchao built for another torch
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    return None


def check_torchao_quant(quant: str, device: torch.device, *, gguf: bool) -> None:
    """Raise ModelLoadError where `--quant int4|fp8` cannot run: off CUDA, on a GGUF file, without
    torchao, or (fp8) on a GPU without FP8 units."""
    if device.type != "cuda":
        raise ModelLoadError(
            f"--quant {quant} is torchao's {quant} weight-only quantization, which runs on CUDA only",
            hint="on the CPU use --quant none (or int8 for a draft)",
        )
    if gguf:
        raise ModelLoadError(
            f"--quant {quant} cannot apply to a GGUF file: transformers dequantizes GGUF weights when it loads "
            "them, and torchao quantizes safetensors weights as they are placed",
            hint=f"drop --quant to load the GGUF dequantized, or use a safetensors model for --quant {quant}",
        )
    problem = torchao_problem()
    if problem is not None:
        raise ModelLoadError(
            f"--quant {quant} needs torchao, which cannot be imported here ({problem})", hint=INSTALL_HINT
        )
    if quant == "fp8" and torch.cuda.get_device_capability(device) < FP8_CAPABILITY:
        raise ModelLoadError(
            f"--quant fp8 needs FP8 units (compute capability 8.9 or later); "
            f"{torch.cuda.get_device_name(device)} has {'.'.join(map(str, torch.cuda.get_device_capability(device)))}",
            hint="use --quant int4 or 4bit",
        )


def torchao_config(quant: str):
    """transformers' TorchAoConfig for `quant` (int4: tinygemm's tile-packed layout)."""
    from torchao.quantization import Float8WeightOnlyConfig, Int4WeightOnlyConfig
    from transformers import TorchAoConfig

    if quant == "int4":
        return TorchAoConfig(Int4WeightOnlyConfig(group_size=INT4_GROUP_SIZE, int4_packing_format="tile_packed_to_4d"))
    if quant == "fp8":
        return TorchAoConfig(Float8WeightOnlyConfig())
    raise ValueError(f"not a torchao quantization: {quant!r}")
