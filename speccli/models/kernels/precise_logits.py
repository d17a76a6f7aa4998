"""Logits with float32 precision where they decide, for models computing in bfloat16 or float16.

A bfloat16 logit between 16 and 32 moves in steps of 0.125, so every pair of candidates
closer than that becomes a coin toss, and a pass over k + 1 tokens may toss it otherwise
than a pass over one: speculative and plain decoding then part at a near-tie
(speccli.bench.divergence). Returning the whole output layer in float32 would cost a
float32 matrix product over the vocabulary (and, on the CPU, a float32 copy of the weights).
Instead the product runs in the model's dtype as before, and its `CANDIDATES` highest
logits of each row are computed again in float32 from the same weights and hidden state:
the tokens greedy decoding picks from, and the bulk of the sampling mass, get float32
precision; the rest keep the dtype's. The candidates are a fixed number, so the pass keeps
static shapes (CUDA graphs, torch.compile).

Not applied when a model loads: measured, it did not make speculative and plain decoding
part less often (BENCHMARKS.md, "Levers tried and not kept"). The output layer's bfloat16
rounding breaks near-ties the same way in a pass over one token and a pass over several
(the lower id), where float32 leaves them to the hidden state's own rounding, and it is
what transformers' own `generate` does. scripts/argmax_flips.py and
scripts/precise_logits_ab.py wrap and unwrap it to measure it again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# A true float32 maximum lies within an ulp of the rounded maximum; more tokens than this
# within one ulp of each other would leave some unrefined (they keep the dtype's precision).
CANDIDATES = 16

REFINED_DTYPES = (torch.bfloat16, torch.float16)


class PreciseLogits(torch.nn.Module):
    """An output layer wrapped so that its highest logits are float32-exact. Returns float32."""

    def __init__(self, head: torch.nn.Linear, candidates: int = CANDIDATES) -> None:
        super().__init__()
        self.head = head
        self.candidates = min(candidates, head.out_features)

    @property
    def weight(self) -> torch.Tensor:
        return self.head.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.head.bias

    @property
    def in_features(self) -> int:
        return self.head.in_features

    @property
    def out_features(self) -> int:
        return self.head.out_features

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        coarse = self.head(hidden)
        top = coarse.topk(self.candidates, dim=-1).indices  # [..., C]
        rows = self.head.weight[top].float()  # [..., C, H]
        exact = torch.matmul(rows, hidden.float().unsqueeze(-1)).squeeze(-1)
        if self.head.bias is not None:
            exact = exact + self.head.bias[top].float()
        return coarse.float().scatter_(-1, top, exact)


def set_precise_logits(model: PreTrainedModel, enabled: bool = True) -> bool:
    """Wrap `model`'s output layer in PreciseLogits when it is a plain Linear computing in
    bfloat16 or float16 (not a quantized one), or (enabled=False) unwrap it. Returns whether
    the output layer is wrapped now."""
    head = model.get_output_embeddings()
    if isinstance(head, PreciseLogits):
        if not enabled:
            model.set_output_embeddings(head.head)
        return enabled
    if not enabled or not isinstance(head, torch.nn.Linear) or head.weight.dtype not in REFINED_DTYPES:
        return False
    model.set_output_embeddings(PreciseLogits(head))
    return True
