"""Windowed attention with grouped query heads (speccli.backends.attention) in the static
backend: the same logits as transformers' own SDPA over the whole cache, across a bucket
boundary, a cache growth and a tree pass; the model still runs `generate` as before."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_llama, wrap, wrap_static
from speccli.backends.attention import WINDOW_SDPA, pack_mask, window_for, windowed_sdpa

TOLERANCE = dict(rtol=1e-5, atol=1e-5)


class Grouped(torch.nn.Module):
    num_key_value_groups = 3
    is_causal = True


def full_sdpa(query, key, value, mask):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(Grouped(), query, key, value, mask, scaling=0.125)[0]


def causal_mask(start: int, n: int, width: int) -> torch.Tensor:
    positions = torch.arange(start, start + n)
    visible = torch.arange(width)[None, :] <= positions[:, None]
    return torch.zeros(n, width).masked_fill_(~visible, torch.finfo(torch.float32).min)[None, None]


@pytest.mark.parametrize("n", [1, 5])
def test_a_window_and_grouped_queries_give_sdpa_over_the_whole_cache(n):
    torch.manual_seed(0)
    slots, start = 64, 20
    query = torch.randn(1, 6, n, 16)
    key, value = torch.randn(1, 2, slots, 16), torch.randn(1, 2, slots, 16)
    whole = full_sdpa(query, key, value, causal_mask(start, n, slots))
    width = 32
    narrow = causal_mask(start, n, width)
    for mask in (narrow, pack_mask(narrow, 3)):  # as built, and as the backend passes it
        out, weights = windowed_sdpa(Grouped(), query, key, value, mask, scaling=0.125)
        assert weights is None and out.shape == (1, n, 6, 16)
        torch.testing.assert_close(out, whole, **TOLERANCE)
    # A packed mask over the whole cache (no narrower window) still takes the grouped path.
    out, _ = windowed_sdpa(Grouped(), query, key, value, pack_mask(causal_mask(start, n, slots), 3), scaling=0.125)
    torch.testing.assert_close(out, whole, **TOLERANCE)


def test_anything_else_goes_to_transformers_sdpa_unchanged(monkeypatch):
    import transformers.integrations.sdpa_attention as sdpa

    calls = []
    monkeypatch.setattr(sdpa, "sdpa_attention_forward", lambda *a, **k: calls.append(a[4]) or ("theirs", None))
    query, key = torch.randn(1, 6, 4, 16), torch.randn(1, 2, 8, 16)
    full = causal_mask(2, 4, 8)
    assert windowed_sdpa(Grouped(), query, key, key, None)[0] == "theirs"
    assert windowed_sdpa(Grouped(), query, key, key, full)[0] == "theirs"  # n rows, the whole cache
    assert calls[0] is None and calls[1] is full


def test_windows_are_buckets_bounded_by_the_capacity():
    assert [window_for(n, 4096) for n in (1, 256, 257, 1500, 4096)] == [256, 256, 512, 2048, 4096]
    assert window_for(100, 64) == 64 and window_for(5000, 8192) == 8192


def test_the_static_backend_windows_sdpa_models_only(tokenizer):
    sdpa = tiny_llama(len(tokenizer), seed=1, max_positions=2048)
    backend = wrap_static(sdpa, capacity=1024)
    assert backend.windowed and sdpa.config._attn_implementation == WINDOW_SDPA
    assert backend.window(10) == 256 and backend.window(300) == 512
    assert wrap_static(sdpa).windowed  # a second backend over the same model
    eager = tiny_llama(len(tokenizer), seed=1, max_positions=2048)
    eager.set_attn_implementation("eager")
    eager_backend = wrap_static(eager, capacity=1024)
    assert not eager_backend.windowed and eager_backend.window(10) == 1024


def test_logits_equal_across_a_bucket_boundary_a_growth_and_a_tree(tokenizer):
    """From 250 cached tokens to 270: windows of 256 then 512, the cache grown from 256 to
    512 slots on the way, chain passes of 1-4 tokens, a rollback and a tree pass."""
    from speccli.tree import ROOT, TokenTree

    model = tiny_llama(len(tokenizer), seed=2, max_positions=1024, logit_scale=10.0)
    reference = wrap(model)
    prompt = [3 + (i * 7) % (len(tokenizer) - 3) for i in range(250)]
    expected = reference.forward(prompt)  # before the switch: transformers' own SDPA
    backend = wrap_static(model, capacity=256, prefill_chunk=100)
    torch.testing.assert_close(backend.forward(prompt), expected, **TOLERANCE)
    fed = list(prompt)
    for n in (1, 4, 2, 3, 4, 1, 4):
        step = [5 + (len(fed) + i) % 30 for i in range(n)]
        fed += step
        torch.testing.assert_close(backend.forward(step), reference.forward(step), **TOLERANCE)
    assert len(fed) == 269 and backend.capacity == 512 and backend.window(len(fed)) == 512
    backend.rollback(254)
    reference.rollback(254)
    tree = TokenTree([10, 11, 12, 13, 14], [ROOT, 0, 0, 1, ROOT])
    nodes = [fed[254], *tree.tokens]
    positions = [254 + d for d in tree.fed_depths()]
    backend.rollback(254)
    reference.rollback(254)
    torch.testing.assert_close(
        backend.forward_tree(nodes, positions, tree.visibility(), 254),
        reference.forward_tree(nodes, positions, tree.visibility(), 254),
        **TOLERANCE,
    )


def test_generate_after_the_switch_gives_the_same_tokens(tokenizer):
    model = tiny_llama(len(tokenizer), seed=4, logit_scale=10.0)
    ids = torch.tensor([[1, 5, 9, 14, 3]])
    before = model.generate(ids, max_new_tokens=12, do_sample=False)
    wrap_static(model)
    assert model.config._attn_implementation == WINDOW_SDPA
    assert torch.equal(model.generate(ids, max_new_tokens=12, do_sample=False), before)
