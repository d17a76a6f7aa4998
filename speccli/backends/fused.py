"""Projections of the same input fused into one matrix product when a model loads: an
attention layer's q, k and v, and a gated MLP's gate and up.

At batch size 1 a projection is a matrix-vector product bound by reading its weights. Three
small ones (grouped-query attention's k and v are a few hundred rows each) use a GPU's
bandwidth worse than one product over their stacked rows, and each is a kernel of its own;
fast engines (vLLM, gpt-fast, TensorRT-LLM) fuse them. transformers' Llama-family modules
call them apart, so:

* an MLP becomes `FusedGatedMLP`: one product, split into gate and up. Its form,
  down(act(gate(x)) * up(x)), is checked against the module it replaces on one input
  before any is replaced;
* an attention layer keeps its own forward (rotary embeddings, cache, attention function)
  and its `q_proj`, `k_proj`, `v_proj` become views of one `StackedProjection`: the first
  asked for computes every part for that input, the others take theirs from it.

Only dense weights are fused: quantized layers (bitsandbytes, torchao), CPU kernels that
specgen swapped in, and layers split over processes (`--tp`) are left as they are.
"""

from __future__ import annotations

from typing import Callable, TypeGuard

import torch
from torch import nn

ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj")
MLP_PARTS = ("gate_proj", "up_proj", "down_proj")


def _dense(module: object) -> TypeGuard[nn.Linear]:
    """A plain nn.Linear over a plain tensor (not a quantized or sharded subclass)."""
    if type(module) is not nn.Linear:
        return False
    tensors = [module.weight] + ([module.bias] if module.bias is not None else [])
    return all(type(t.data) is torch.Tensor for t in tensors)


def _dense_parts(module: nn.Module, names: tuple[str, ...]) -> list[nn.Linear] | None:
    """The module's projections `names`, where every one is there and dense (`_dense`)."""
    parts = [part for part in (getattr(module, name, None) for name in names) if _dense(part)]
    return parts if len(parts) == len(names) else None


def _linear(module: nn.Module, name: str) -> nn.Linear:
    """The module's projection `name` (a Linear: `_dense_parts` found it so)."""
    part = getattr(module, name)
    if not isinstance(part, nn.Linear):
        raise TypeError(f"{type(module).__name__}.{name} is a {type(part).__name__}, not a Linear")
    return part


def _stack(linears: list[nn.Linear]) -> nn.Linear:
    """One Linear whose rows are the linears' rows in order (the inputs must agree)."""
    first = linears[0]
    rows = sum(linear.out_features for linear in linears)
    stacked = nn.Linear(first.in_features, rows, bias=first.bias is not None, device="meta")
    with torch.no_grad():
        stacked.weight = nn.Parameter(torch.cat([linear.weight for linear in linears]), requires_grad=False)
        if first.bias is not None:
            stacked.bias = nn.Parameter(torch.cat([linear.bias for linear in linears]), requires_grad=False)
    return stacked


class StackedProjection(nn.Module):
    """Several projections of one input as one product; `part(x, i)` is the i-th's output."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        super().__init__()
        self.stacked = _stack(linears)
        self.sizes = [linear.out_features for linear in linears]
        self._input: torch.Tensor | None = None
        self._parts: tuple[torch.Tensor, ...] = ()
        self._taken: set[int] = set()

    def part(self, x: torch.Tensor, index: int) -> torch.Tensor:
        # A new input, or a part asked for twice: compute every part again. The parts of one
        # input are asked for before it changes (an attention layer asks for q, k, v in a row);
        # the outputs are let go once each part was taken (the input may change afterwards).
        if self._input is not x or index in self._taken:
            self._parts = tuple(self.stacked(x).split(self.sizes, dim=-1))
            self._input, self._taken = x, set()
        self._taken.add(index)
        out = self._parts[index]
        if len(self._taken) == len(self.sizes):
            self._input, self._parts, self._taken = None, (), set()
        return out


class ProjectionPart(nn.Module):
    """Stands where one of the stacked projections stood (`attention.q_proj`, ...)."""

    _stacked: StackedProjection

    def __init__(self, stacked: StackedProjection, index: int) -> None:
        super().__init__()
        # Kept out of the module tree: the parent registers the stacked weights once.
        self.__dict__["_stacked"] = stacked
        self.index = index
        self.out_features = stacked.sizes[index]
        self.in_features = stacked.stacked.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._stacked.part(x, self.index)


class FusedGatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up as one product."""

    act_fn: Callable[[torch.Tensor], torch.Tensor]

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        gate = _linear(mlp, "gate_proj")
        self.gate_up = _stack([gate, _linear(mlp, "up_proj")])
        self.down_proj = _linear(mlp, "down_proj")
        act_fn = getattr(mlp, "act_fn", None)
        if not callable(act_fn):
            raise TypeError(f"{type(mlp).__name__} has no act_fn to call")
        self.act_fn = act_fn
        self.intermediate = gate.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.intermediate, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


def _gated_mlp(module: nn.Module) -> bool:
    return _dense_parts(module, MLP_PARTS) is not None and callable(getattr(module, "act_fn", None))


def _attention(module: nn.Module) -> bool:
    parts = _dense_parts(module, ATTENTION_PARTS)
    return parts is not None and len({p.in_features for p in parts}) == 1


def _same_output(original: nn.Module, fused: nn.Module) -> bool:
    """The fused MLP computes what the module it replaces computes, on one random row scaled
    so that the gate's inputs are of order one (near zero, SiLU is nearly linear and a gate
    swapped with its up projection would pass unnoticed)."""
    gate = _linear(original, "gate_proj")
    weight = gate.weight
    x = torch.randn(1, 1, gate.in_features, dtype=weight.dtype, device=weight.device)
    with torch.inference_mode():
        x = x * (2.0 / gate(x).float().std().clamp_min(1e-6)).to(x.dtype)
        want, got = original(x).float(), fused(x).float()
    return bool(torch.allclose(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max())))


def fuse_projections(model: nn.Module) -> int:
    """Fuse each decoder layer's q/k/v and gate/up where the weights are dense; returns the
    layers changed. An MLP whose forward is not of the gated form is left as it is."""
    layers = getattr(getattr(model, "base_model", model), "layers", None)
    if layers is None:
        return 0
    changed = 0
    checked: dict[type, bool] = {}
    for layer in layers:
        touched = False
        attention = getattr(layer, "self_attn", None)
        if attention is not None and _attention(attention):
            stacked = StackedProjection([getattr(attention, name) for name in ATTENTION_PARTS])
            attention.stacked_qkv = stacked
            for index, name in enumerate(ATTENTION_PARTS):
                setattr(attention, name, ProjectionPart(stacked, index))
            touched = True
        mlp = getattr(layer, "mlp", None)
        if mlp is not None and _gated_mlp(mlp):
            fused = FusedGatedMLP(mlp)
            kind = type(mlp)
            if kind not in checked:
                checked[kind] = _same_output(mlp, fused)
            if checked[kind]:
                layer.mlp = fused
                touched = True
        changed += touched
        if touched and next(layer.parameters()).is_cuda:
            # The replaced weights' blocks are of other sizes than the stacked ones: hand them
            # back to the driver now, or a model near the GPU's size would run out on the way.
            torch.cuda.empty_cache()
    return changed


def unfused_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """`module.state_dict()` with fused weights split back under the names they had before
    (an EAGLE head starts from the target's last layer, whose names it shares)."""
    state = module.state_dict()
    for prefix, child in module.named_modules():
        dot = f"{prefix}." if prefix else ""
        if isinstance(child, StackedProjection):  # <attention>.stacked_qkv stands for <attention>.q_proj, ...
            _split(state, f"{dot}stacked.", dot.removesuffix("stacked_qkv."), ATTENTION_PARTS, child.sizes)
        elif isinstance(child, FusedGatedMLP):
            _split(state, f"{dot}gate_up.", dot, MLP_PARTS[:2], [child.intermediate] * 2)
    return state


def _split(state: dict[str, torch.Tensor], stacked: str, parent: str, names: tuple[str, ...], sizes: list[int]) -> None:
    for kind in ("weight", "bias"):
        whole = state.pop(f"{stacked}{kind}", None)
        if whole is not None:
            for name, part in zip(names, whole.split(sizes)):
                state[f"{parent}{name}.{kind}"] = part
