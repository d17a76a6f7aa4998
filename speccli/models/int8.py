"""Dynamic int8 quantization of a model's linear layers on the CPU, for drafts.

On a CPU a draft token is bound by reading the weights: int8 weights are a quarter of
float32's bytes, and PyTorch's x86 kernels multiply them with int8 activations quantized
on the fly. So an int8 draft token costs well under a bfloat16 or float32 one, and less
than with bitsandbytes' 4- or 8-bit CPU kernels or torchao without torch.compile
(measured: BENCHMARKS.md, section "Levers tried and not kept").

The draft's distribution shifts slightly, which changes only how often its tokens are
accepted: verification keeps the output the target's own. The target is never quantized
by default, since its output is what the user asked for.
"""

from __future__ import annotations

import functools
import warnings

import torch


@functools.lru_cache(maxsize=None)
def int8_problem() -> str | None:
    """None when this PyTorch can quantize linear layers dynamically to int8, else why not."""
    try:
        from torch.ao.quantization import quantize_dynamic  # noqa: F401
    except ImportError as exc:  # removed in some future PyTorch (deprecated since 2.10)
        return f"this PyTorch has no torch.ao.quantization.quantize_dynamic ({exc})"
    engines = torch.backends.quantized.supported_engines
    if not any(engine in engines for engine in ("x86", "fbgemm", "onednn", "qnnpack")):
        return f"this PyTorch has no quantized CPU engine (supported: {engines})"
    return None


def quantize_int8(model: torch.nn.Module) -> torch.nn.Module:
    """Replace every nn.Linear of a float32 model on the CPU with a dynamically quantized
    int8 one (per-tensor weights, activations quantized per call). Returns the model."""
    from torch.ao.quantization import quantize_dynamic

    with warnings.catch_warnings():
        # PyTorch announces that torch.ao.quantization will move to torchao; torchao's
        # CPU path is several times slower without torch.compile, so this stays for now.
        warnings.simplefilter("ignore")
        return quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)
