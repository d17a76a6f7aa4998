"""The static-cache backend (speccli.backends.static): the same tokens and logits as
the DynamicCache backend; rollback only moves the write position; CUDA graphs on CUDA."""

from __future__ import annotations

import time

import pytest
import torch

from conftest import tiny_llama, wrap, wrap_static
from speccli.backends.static import StaticCacheUnsupported, StaticCausalLM, static_cache_problem
from speccli.config import SamplingConfig, SpecConfig
from speccli.drafters.model import ModelDrafter
from speccli.events import StepEvent
from speccli.loop import SpeculativeDecoder
from test_decoder_greedy import EOS, MAX_NEW, PROMPTS, emitted, encode, target_greedy
from test_decoder_state import assert_cache_matches_fresh_prefill


@pytest.fixture(scope="module")
def references(pairs, tokenizer):
    return {
        (pair.name, prompt): target_greedy(pair.target, encode(tokenizer, prompt))
        for pair in pairs
        for prompt in PROMPTS
    }


@pytest.mark.parametrize("k", [1, 4, "auto"])
@pytest.mark.parametrize("pair_index", [0, 1])
def test_static_target_and_draft_equal_target_greedy(pairs, tokenizer, references, pair_index, k):
    pair = pairs[pair_index]
    # A small first capacity so that the cache also grows (and keeps its contents) on the way.
    target = wrap_static(pair.target, capacity=16)
    draft = wrap_static(pair.draft, capacity=16)
    decoder = SpeculativeDecoder(target, tokenizer, [EOS], ModelDrafter(draft, len(tokenizer)))
    drafted = 0
    for prompt in PROMPTS:
        events = list(
            decoder.generate(encode(tokenizer, prompt), SamplingConfig(), SpecConfig(k=k, max_new_tokens=MAX_NEW))
        )
        assert emitted(events) == references[(pair.name, prompt)], prompt
        drafted += sum(e.drafted for e in events if isinstance(e, StepEvent))
    assert drafted > 0
    assert target.capacity > 16


class CapturesOnFirstUse:
    """A backend whose first pass of each size spends `pause` seconds of one-time setup, as
    a CUDA graph capture does, and says so in `setup_seconds`."""

    def __init__(self, lm, pause: float = 0.3) -> None:
        self._lm, self._pause, self._sizes = lm, pause, set()
        self.setup_seconds = 0.0

    def __getattr__(self, name):
        return getattr(self._lm, name)

    def forward(self, token_ids, all_logits=True):
        if len(token_ids) not in self._sizes:
            self._sizes.add(len(token_ids))
            time.sleep(self._pause)
            self.setup_seconds += self._pause
        return self._lm.forward(token_ids, all_logits)


def test_one_time_setup_inside_passes_is_kept_out_of_the_step_timings(pairs, tokenizer):
    pair = pairs[0]
    target, draft = CapturesOnFirstUse(wrap_static(pair.target)), CapturesOnFirstUse(wrap_static(pair.draft))
    decoder = SpeculativeDecoder(target, tokenizer, [EOS], ModelDrafter(draft, len(tokenizer)))
    events = list(decoder.generate(encode(tokenizer, PROMPTS[0]), SamplingConfig(), SpecConfig(k=3, max_new_tokens=12)))
    steps = [e for e in events if isinstance(e, StepEvent)]
    assert target.setup_seconds >= 0.6 and draft.setup_seconds >= 0.6  # several sizes were "captured"
    assert all(e.verify_seconds < 0.25 and e.draft_seconds - e.catch_up_seconds < 0.25 for e in steps)
    assert all(e.catch_up_seconds < 0.25 for e in steps)


def test_rollback_only_moves_the_write_position(pairs, tokenizer):
    """Rolled-back entries stay where they were (nothing copied or cleared); new tokens
    overwrite them, and the logits after rollback + new tokens are a fresh model's."""
    pair = pairs[1]
    backend = wrap_static(pair.target)
    ids = encode(tokenizer, "hello world, hello")
    backend.forward(ids)
    keys = backend._cache.layers[0].keys
    before = keys.clone()
    backend.rollback(5)
    assert keys.data_ptr() == backend._cache.layers[0].keys.data_ptr()
    assert torch.equal(keys, before)
    assert [int(layer.cumulative_length) for layer in backend._cache.layers] == [5] * len(backend._cache.layers)
    new = encode(tokenizer, "xyz")
    logits = backend.forward(new)
    with torch.no_grad():
        fresh = pair.target(input_ids=torch.tensor([ids[:5] + new])).logits[0, 5:]
    torch.testing.assert_close(logits, fresh, rtol=1e-5, atol=1e-5)
    backend.rollback(0)
    assert list(backend.cached_tokens) == []
    torch.testing.assert_close(
        backend.forward(ids, all_logits=False), wrap(pair.target).forward(ids)[-1:], rtol=1e-5, atol=1e-5
    )


def test_long_prompts_prefill_in_chunks_and_grow_the_cache(pairs, tokenizer):
    pair = pairs[0]
    backend = wrap_static(pair.target, capacity=8, prefill_chunk=7)
    ids = encode(tokenizer, "The quick brown fox jumps over the lazy dog. " * 2)
    last = backend.forward(ids, all_logits=False)
    every = wrap(pair.target).forward(ids)
    torch.testing.assert_close(last, every[-1:], rtol=1e-5, atol=1e-5)
    assert backend.capacity >= len(ids)
    backend.rollback(0)
    torch.testing.assert_close(backend.forward(ids), every, rtol=1e-5, atol=1e-5)


def test_context_is_bounded_by_the_model(tokenizer):
    model = tiny_llama(len(tokenizer), seed=3, max_positions=12)
    backend = wrap_static(model, capacity=4096)
    assert backend.capacity == 12 and backend.max_length == 12
    backend.forward(list(range(3, 15)))
    with pytest.raises(ValueError, match="exceeds"):
        backend.forward([3])
    assert len(backend.cached_tokens) == 12


def test_an_interrupted_pass_leaves_the_cache_whole(pairs, tokenizer):
    pair = pairs[0]
    backend = wrap_static(pair.target)
    ids = encode(tokenizer, "def fib(n):")
    backend.forward(ids)
    layer = pair.target.model.layers[1]
    original = layer.forward

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    layer.forward = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            backend.forward(encode(tokenizer, " return"))
    finally:
        layer.forward = original
    assert list(backend.cached_tokens) == ids
    assert_cache_matches_fresh_prefill(backend, pair.target, 5)


def test_models_the_static_cache_cannot_serve_are_refused():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=40,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=1,
    )
    model = Qwen2ForCausalLM(config)
    assert "StaticSlidingWindowLayer" in static_cache_problem(model)
    with pytest.raises(StaticCacheUnsupported):
        StaticCausalLM(model)


def test_no_graphs_on_the_cpu(pairs):
    backend = wrap_static(pairs[0].target, graphs=True)
    assert not backend.graphs_enabled
    backend.forward([5, 6, 7])
    assert backend.graphed_sizes == []


# --------------------------------------------------------------------------- choosing the backend


def loaded(model, device="cpu", dtype=torch.float32, quant="none"):
    from types import SimpleNamespace

    return SimpleNamespace(model=model, device=torch.device(device), dtype=dtype, quant=quant, backend="transformers")


def test_cuda_graphs_auto_picks_the_static_backend_only_on_cuda_in_half_precision_or_4_8_bit(pairs):
    from speccli.pipeline import uses_cuda_graphs

    model = pairs[0].target
    assert not uses_cuda_graphs(loaded(model))  # the CPU keeps the DynamicCache path
    assert not uses_cuda_graphs(loaded(model, dtype=torch.bfloat16))
    assert uses_cuda_graphs(loaded(model, "cuda", torch.bfloat16))
    assert uses_cuda_graphs(loaded(model, "cuda:1", torch.float16))
    assert uses_cuda_graphs(loaded(model, "cuda", torch.bfloat16, quant="4bit"))
    assert uses_cuda_graphs(loaded(model, "cuda", torch.float32, quant="8bit"))
    assert not uses_cuda_graphs(loaded(model, "cuda", torch.float32))
    assert not uses_cuda_graphs(loaded(model, "cuda", torch.bfloat16), "off")


def test_the_cpu_pipeline_keeps_the_dynamic_cache(pairs):
    from speccli.backends.hf import HFCausalLM
    from speccli.pipeline import backend_label, causal_lm

    lm = causal_lm(loaded(pairs[0].target))
    assert isinstance(lm, HFCausalLM) and backend_label(lm) == "dynamic-cache"
    assert backend_label(wrap_static(pairs[0].target)) == "static-cache"


def test_generate_reports_the_backend_and_checks_the_option(tmp_path, tokenizer):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from conftest import save_model_folder

    repo = Path(__file__).resolve().parents[1]
    model = tiny_llama(len(tokenizer), seed=1, logit_scale=20.0)
    folder = str(save_model_folder(model, tokenizer, tmp_path / "target"))

    def specgen(*args):
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "speccli.cli",
                "generate",
                "abc",
                "--target",
                folder,
                "--draft",
                "none",
                "--dtype",
                "float32",
                "-n",
                "4",
                "--json",
                "-q",
                *args,
            ],
            capture_output=True,
            cwd=repo,
            env={**os.environ, "PYTHONPATH": str(repo), "SPECGEN_CACHE": str(tmp_path)},
            timeout=300,
        )

    ok = specgen("--cuda-graphs", "auto")
    assert ok.returncode == 0, ok.stderr.decode()
    assert json.loads(ok.stdout)["settings"]["backend"] == "dynamic-cache"
    bad = specgen("--cuda-graphs", "on")
    assert bad.returncode == 2 and "cuda_graphs must be one of auto, off" in bad.stderr.decode()


# --------------------------------------------------------------------------- CUDA only


def cuda_copy(model, dtype=torch.float32):
    return model.to(device="cuda", dtype=dtype)


@pytest.fixture
def cuda_pair(tokenizer):
    from conftest import model_pairs

    pair = model_pairs(len(tokenizer))[0]
    return pair.__class__(pair.name, cuda_copy(pair.target), cuda_copy(pair.draft))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_replay_gives_the_eager_logits(tokenizer, dtype):
    model = tiny_llama(len(tokenizer), seed=1, logit_scale=20.0).to(device="cuda", dtype=dtype)
    graphed = wrap_static(model, max_fed=9)
    eager = wrap_static(model, graphs=False)
    assert graphed.graphs_enabled and not eager.graphs_enabled
    prompt = encode(tokenizer, "def fib(n):\n    return")
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(graphed.forward(prompt), eager.forward(prompt), **tolerance)  # 23 tokens: eager
    for n in (1, 3, 9, 1, 3):  # each size captured once, then replayed
        feed = list(range(10, 10 + n))
        torch.testing.assert_close(graphed.forward(feed), eager.forward(feed), **tolerance)
        graphed.rollback(len(prompt) + 1)
        eager.rollback(len(prompt) + 1)
    assert graphed.graphs_error is None
    assert graphed.graphed_sizes == [1, 3, 9]


@pytest.mark.cuda
def test_graphed_decoding_equals_target_greedy_on_cuda(cuda_pair, tokenizer):
    target = wrap_static(cuda_pair.target, capacity=32)  # grows: graphs are captured again
    draft = wrap_static(cuda_pair.draft, capacity=32)
    decoder = SpeculativeDecoder(target, tokenizer, [EOS], ModelDrafter(draft, len(tokenizer)))
    for prompt in PROMPTS[:6]:
        for k in (1, 4, "auto"):
            ids = encode(tokenizer, prompt)
            events = list(decoder.generate(ids, SamplingConfig(), SpecConfig(k=k, max_new_tokens=MAX_NEW)))
            assert emitted(events) == target_greedy(cuda_pair.target, ids), (prompt, k)
    assert target.graphs_error is None and draft.graphs_error is None
    assert target.graphed_sizes and 1 in draft.graphed_sizes
    assert draft.chains and 4 in draft.graphed_chain_lengths  # the draft's k tokens, one graph
    assert target.capacity > 32


@pytest.mark.cuda
def test_graphed_tree_passes_give_the_eager_logits(tokenizer):
    from speccli.tree import ROOT, TokenTree

    model = tiny_llama(len(tokenizer), seed=1, logit_scale=20.0).to(device="cuda")
    graphed = wrap_static(model, max_fed=9)
    eager = wrap_static(model, graphs=False)
    prompt = encode(tokenizer, "def fib(n):\n    return")
    graphed.forward(prompt[:-1])
    eager.forward(prompt[:-1])
    cached = len(prompt) - 1
    tree = TokenTree([10, 11, 12, 13, 14], [ROOT, 0, 0, 1, ROOT])
    fed = [prompt[-1], *tree.tokens]
    positions = [cached + d for d in tree.fed_depths()]
    for _ in range(2):  # captured, then replayed
        torch.testing.assert_close(
            graphed.forward_tree(fed, positions, tree.visibility(), cached),
            eager.forward_tree(fed, positions, tree.visibility(), cached),
            rtol=1e-5,
            atol=1e-5,
        )
        graphed.rollback(cached)
        eager.rollback(cached)
    # A chain of the same size has its own graph (its mask comes from the positions).
    torch.testing.assert_close(graphed.forward(fed), eager.forward(fed), rtol=1e-5, atol=1e-5)
    assert graphed.graphs_error is None
    assert graphed.graphed_tree_sizes == [6] and graphed.graphed_sizes == [6]


@pytest.mark.cuda
def test_graphed_trees_and_lookahead_equal_target_greedy_on_cuda(cuda_pair, tokenizer):
    from speccli.drafters.lookahead import LookaheadDrafter

    target = wrap_static(cuda_pair.target, max_fed=32)
    draft = wrap_static(cuda_pair.draft, max_fed=32)
    trees = SpeculativeDecoder(target, tokenizer, [EOS], ModelDrafter(draft, len(tokenizer)))
    for prompt in PROMPTS[:4]:
        ids = encode(tokenizer, prompt)
        events = list(trees.generate(ids, SamplingConfig(), SpecConfig(k=4, max_new_tokens=MAX_NEW, tree=True)))
        assert emitted(events) == target_greedy(cuda_pair.target, ids), prompt
    lookahead_target = wrap_static(cuda_pair.target, max_fed=32)
    lookahead = SpeculativeDecoder(lookahead_target, tokenizer, [EOS], LookaheadDrafter())
    for prompt in PROMPTS[:4]:
        ids = encode(tokenizer, prompt)
        events = list(lookahead.generate(ids, SamplingConfig(), SpecConfig(k=3, max_new_tokens=MAX_NEW)))
        assert emitted(events) == target_greedy(cuda_pair.target, ids), prompt
    for lm in (target, draft, lookahead_target):
        assert lm.graphs_error is None
    assert target.graphed_tree_sizes and lookahead_target.graphed_tree_sizes
