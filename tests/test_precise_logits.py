"""Float32-precise top logits for bfloat16/float16 models (speccli.models.kernels.precise_logits)."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import tiny_llama, wrap
from speccli.models.kernels.precise_logits import CANDIDATES, PreciseLogits, set_precise_logits


def exact_logits(head: torch.nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    return hidden.float() @ head.weight.float().T


def test_the_highest_logits_are_float32_exact_and_the_rest_keep_the_dtype():
    torch.manual_seed(0)
    head = torch.nn.Linear(64, 500, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        head.weight.mul_(8)
    hidden = torch.randn(3, 64).to(torch.bfloat16)
    coarse = head(hidden).float()
    exact = exact_logits(head, hidden)
    with torch.no_grad():
        precise = PreciseLogits(head)(hidden)
    assert precise.dtype == torch.float32
    top = coarse.topk(CANDIDATES, dim=-1).indices
    refined = torch.zeros_like(precise, dtype=torch.bool).scatter_(-1, top, True)
    torch.testing.assert_close(precise[refined], exact[refined], rtol=0, atol=1e-4)
    assert torch.equal(precise[~refined], coarse[~refined])
    # bfloat16 rounded the refined ones (steps of 1/8 and more at these magnitudes): now they are not.
    assert not torch.equal(coarse[refined], exact[refined])
    assert torch.equal(precise.argmax(dim=-1), exact.argmax(dim=-1))


def test_a_tie_in_bfloat16_is_told_apart():
    head = torch.nn.Linear(2, 3, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        # 16.0 + 0.03 and 16.0 + 0.06 both round to 16.0 in bfloat16; the second is the larger.
        head.weight.copy_(torch.tensor([[16.0, 0.0], [0.0, 16.0], [1.0, 1.0]]))
        head.bias.copy_(torch.tensor([0.0, 0.0, 0.0]))
        hidden = torch.tensor([[1.0, 1.0]], dtype=torch.bfloat16)
        head.weight[0, 1] = 0.03125  # exact in bfloat16
        head.weight[1, 0] = 0.0625
        assert head(hidden)[0, 0] == head(hidden)[0, 1] == 16.0  # a coin toss for argmax
        precise = PreciseLogits(head, candidates=2)(hidden)
    assert precise[0].tolist()[:2] == [16.03125, 16.0625]
    assert int(precise.argmax()) == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_model_is_wrapped_and_unwrapped(dtype):
    model = tiny_llama(40, seed=3, logit_scale=10.0).to(dtype)
    original = model.get_output_embeddings()
    assert set_precise_logits(model) is True
    head = model.get_output_embeddings()
    assert isinstance(head, PreciseLogits) and head.head is original
    assert head.weight is original.weight and head.out_features == 40
    assert set_precise_logits(model) is True  # already: not wrapped twice
    assert model.get_output_embeddings() is head
    assert set_precise_logits(model, enabled=False) is False
    assert model.get_output_embeddings() is original


def test_float32_models_are_left_alone():
    model = tiny_llama(40, seed=3)
    original = model.get_output_embeddings()
    assert set_precise_logits(model) is False
    assert model.get_output_embeddings() is original


def test_the_backend_returns_the_precise_logits():
    model = tiny_llama(40, seed=3, logit_scale=10.0).to(torch.bfloat16)
    plain = copy.deepcopy(model)
    set_precise_logits(model)
    ids = [5, 9, 11, 7]
    precise = wrap(model).forward(ids)
    coarse = wrap(plain).forward(ids)
    assert precise.dtype == torch.float32 and precise.shape == coarse.shape == (4, 40)
    changed = precise != coarse
    assert changed.any() and changed.sum(dim=-1).max() <= CANDIDATES
    # Only the refinement differs: each changed logit is within an ulp of its bfloat16 value.
    assert ((precise - coarse).abs()[changed] <= coarse.abs()[changed] * 2**-7).all()
