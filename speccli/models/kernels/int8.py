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
from concurrent.futures import ThreadPoolExecutor

import torch


@functools.lru_cache(maxsize=None)
def int8_problem() -> str | None:
    """None when this PyTorch can quantize linear layers dynamically to int8, else why not."""
    try:  # what _dynamic_int8 uses; removed in some future PyTorch (deprecated since 2.10)
        from torch.ao.nn.quantized.dynamic import Linear  # noqa: F401
        from torch.ao.nn.quantized.modules.utils import _quantize_weight  # noqa: F401
        from torch.ao.quantization.qconfig import default_dynamic_qconfig  # noqa: F401
    except ImportError as exc:
        return f"this PyTorch has no dynamic int8 linear layers in torch.ao ({exc})"
    engines = torch.backends.quantized.supported_engines
    if not any(engine in engines for engine in ("x86", "fbgemm", "onednn", "qnnpack")):
        return f"this PyTorch has no quantized CPU engine (supported: {engines})"
    return None


def quantize_int8(model: torch.nn.Module) -> torch.nn.Module:
    """Replace every nn.Linear of a float32 model on the CPU with a dynamically quantized
    int8 one (per-tensor weights, activations quantized per call). Returns the model.

    The same modules as ``torch.ao.quantization.quantize_dynamic`` gives, faster: its
    modules pack an empty matrix of the full size before the real one, and packing runs in
    C++ without the GIL, so the layers are quantized on a thread per core (timings:
    BENCHMARKS.md, "Figures behind options")."""
    linears = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is torch.nn.Linear
    ]
    with warnings.catch_warnings():
        # PyTorch announces that torch.ao.quantization will move to torchao; torchao's
        # CPU path is several times slower without torch.compile, so this stays for now.
        warnings.simplefilter("ignore")
        with ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
            quantized = list(pool.map(lambda place: _dynamic_int8(place[2]), linears))
    for (parent, name, _), module in zip(linears, quantized):
        setattr(parent, name, module)
    return model


def _dynamic_int8(linear: torch.nn.Linear) -> torch.nn.Module:
    """``torch.ao.nn.quantized.dynamic.Linear.from_float(linear)`` with the default dynamic
    qconfig, without packing a full-size empty matrix first."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear
    from torch.ao.nn.quantized.modules.utils import _quantize_weight
    from torch.ao.quantization.qconfig import default_dynamic_qconfig

    observer = default_dynamic_qconfig.weight()
    observer(linear.weight)
    weight = _quantize_weight(linear.weight.float(), observer)
    module = DynamicLinear(1, 1, bias_=linear.bias is not None, dtype=torch.qint8)
    module.in_features, module.out_features = linear.in_features, linear.out_features
    module.set_weight_bias(weight, linear.bias)
    return module
