"""float32 linear layers through oneDNN on the CPU.

For float32 on the CPU, nn.Linear multiplies with MKL's sgemm, which is slow for the
few rows that decoding feeds: on the 2-core AVX512 machine here (torch 2.13) the two
MLP matmuls of a Qwen2.5-Coder-1.5B layer cost 6 ms for 1 row and 12-18 ms for 2 to 9
rows. oneDNN's linear kernel (the one PyTorch already uses for bfloat16, and that
torch.compile's CPU backend uses for float32) costs 3.5-6 ms for 1 to 9 rows. Whole
model: a pass over 1 new token 370-400 -> 200-240 ms, over 9 new tokens 870-940 ->
380-400 ms. A flat verify cost is what speculative decoding lives on, and plain
decoding gains too.

The arithmetic is float32 either way; only the summation order differs, so results
differ by float32 rounding (as a pass over k+1 tokens already does from k+1 one-token
passes). The same weight tensors are used: nothing is copied or re-packed.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # A private op (torch.compile's CPU backend calls it); its availability is probed
    # once by onednn_problem(), and any model it cannot serve keeps nn.Linear.
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@functools.lru_cache(maxsize=None)
def onednn_problem() -> str | None:
    """None when this PyTorch computes float32 linear layers with oneDNN correctly, else why not."""
    if not torch.backends.mkldnn.is_available():
        return "this PyTorch was built without oneDNN (mkldnn)"
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return "this PyTorch has no torch.ops.mkldnn._linear_pointwise"
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(24, 40, generator=generator)
    bias = torch.randn(24, generator=generator)
    x = torch.randn(2, 3, 40, generator=generator)
    try:
        with torch.inference_mode():
            got = _onednn_linear(x, weight, bias)
    except Exception as exc:  # an op that exists but fails on this CPU
        return f"oneDNN's linear failed here ({type(exc).__name__}: {exc})"
    if got.shape != (2, 3, 24) or not torch.allclose(got, F.linear(x, weight, bias), rtol=1e-4, atol=1e-4):
        return "oneDNN's linear disagreed with nn.Linear on a probe"
    return None


class OneDnnLinear(torch.nn.Linear):
    """nn.Linear whose float32 CPU inference goes through oneDNN; anything else (autograd,
    other dtypes or devices) takes nn.Linear's own path."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Linear's name
        weight = self.weight
        if (
            input.dtype != torch.float32
            or weight.dtype != torch.float32
            or input.device.type != "cpu"
            or weight.device.type != "cpu"
            or (torch.is_grad_enabled() and (input.requires_grad or weight.requires_grad))
        ):
            return F.linear(input, weight, self.bias)
        return _onednn_linear(input, weight, self.bias)


def set_onednn_linear(model: torch.nn.Module, enabled: bool = True) -> int:
    """Switch every float32 CPU nn.Linear of `model` to OneDnnLinear (or back, with
    enabled=False). Returns how many layers are switched.

    The layers change class in place rather than being replaced: the module objects,
    their parameters (tied embeddings included), hooks and state_dict stay as they are,
    and switching back is exact.
    """
    switched = 0
    for module in model.modules():
        if type(module) not in (torch.nn.Linear, OneDnnLinear):
            continue
        weight = module.weight
        if weight.dtype != torch.float32 or weight.device.type != "cpu":
            continue
        module.__class__ = OneDnnLinear if enabled else torch.nn.Linear
        switched += 1
    return switched


def uses_onednn_linear(model: torch.nn.Module) -> bool:
    return any(type(module) is OneDnnLinear for module in model.modules())
