"""Published draft heads (speccli.models.pairs.published_heads): EAGLE-3, EAGLE-1/2 and Medusa checkpoints
in the layouts of the Hub files (tests/published_layouts.py), written here for tiny targets,
loaded, checked against the target before their weights, and drafting losslessly; trained
tiny heads (tests/head_references.py) show the loader wires them as their sources do."""

from __future__ import annotations

import collections
import json

import pytest
import torch
from typer.testing import CliRunner

import head_references as ref
import speccli.loop as decoder_module
from conftest import char_tokenizer, save_model_folder, tiny_llama, wrap, wrap_static
from published_layouts import (
    EAGLE3_SHAPES,
    EAGLE_SHAPES,
    dims,
    draft_ids_with_gaps,
    medusa_tensors,
    random_tensors,
    write_eagle,
    write_eagle3,
    write_medusa,
)
from speccli.cli import app
from speccli.config import SamplingConfig, SpecConfig
from speccli.coupling import PositionNoise
from speccli.events import StepEvent
from speccli.loop import SpeculativeDecoder
from speccli.models.errors import HeadsMismatch
from speccli.models.pairs.published_drafter import published_drafter
from speccli.models.pairs.published_heads import check_head, default_feature_layers, read_head
from test_decoder_greedy import emitted, encode, target_greedy
from test_decoder_sampling import ALPHABET
from test_heads import TEXT, assert_samples_follow_the_target

LAYERS = 8  # the tiny targets' decoder layers: EAGLE-3 reads the inputs of layers 2, 4 and 5
DRAFT_VOCAB = 40
PROMPTS = ["def add(a, b):\n", "for i in range(10):\n    print(", "class Point:\n    def", "x = [1, 2, 3]\n"]
ON_CPU = ["--device", "cpu", "--dtype", "float32"]


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


@pytest.fixture(scope="module")
def target(tokenizer):
    return tiny_llama(len(tokenizer), seed=3, layers=LAYERS, logit_scale=4.0)


def eagle3_folder(folder, target, fmt="bin", speculators=False, seed=1, **config):
    sizes = {**dims(target.config), "W": DRAFT_VOCAB}
    shapes = {k: v for k, v in EAGLE3_SHAPES.items() if k not in ("d2t", "t2d")}
    ids = draft_ids_with_gaps(target.config.vocab_size, DRAFT_VOCAB)
    return write_eagle3(folder, target.config, random_tensors(shapes, sizes, seed), ids, fmt, speculators, **config)


def eagle_folder(folder, target, fmt="bin", bias=True, seed=2):
    shapes = {k: v for k, v in EAGLE_SHAPES.items() if bias or k != "fc.bias"}
    return write_eagle(folder, target.config, random_tensors(shapes, dims(target.config), seed), fmt)


def medusa_folder(folder, target, fmt="pt", heads=3, layers=1, seed=4):
    rows = target.lm_head.weight.detach()
    return write_medusa(folder, medusa_tensors(dims(target.config), heads, layers, seed, rows), heads, layers, fmt)


LAYOUTS = {
    "eagle3-bin": ("eagle3", lambda f, t: eagle3_folder(f, t)),
    "eagle3-speculators": ("eagle3", lambda f, t: eagle3_folder(f, t, "safetensors", speculators=True)),
    "eagle-bin": ("eagle", lambda f, t: eagle_folder(f, t)),
    "eagle-nobias": ("eagle", lambda f, t: eagle_folder(f, t, "safetensors", bias=False)),
    "medusa-pt": ("medusa", lambda f, t: medusa_folder(f, t)),
    "medusa-2layers": ("medusa", lambda f, t: medusa_folder(f, t, "safetensors", heads=4, layers=2)),
}


def load(layout, folder, target):
    head = read_head(str(folder), layout)
    check_head(head, target.config, "tiny-target")
    return published_drafter(head, wrap(target), target.config, torch.float32)


# --------------------------------------------------------------------------- the features EAGLE-3 reads


@pytest.mark.parametrize("backend", [wrap, wrap_static], ids=["dynamic", "static"])
def test_layer_inputs_are_transformers_hidden_states(tokenizer, target, backend):
    lm = backend(target)
    layers = default_feature_layers(LAYERS)
    assert layers == (2, 4, 5)
    lm.capture_hidden(layers)
    ids = encode(tokenizer, "def fib(n): return n")
    lm.forward(ids[:-3], all_logits=False)
    first = lm.last_hidden
    logits = lm.forward(ids[-3:])
    features = torch.cat([first, lm.last_hidden])
    with torch.no_grad():
        out = target(input_ids=torch.tensor([ids]), output_hidden_states=True)
    want = torch.cat([out.hidden_states[i][0] for i in layers], -1)
    assert features.shape == (len(ids), 3 * target.config.hidden_size)
    torch.testing.assert_close(features, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits, out.logits[0, -3:].float(), rtol=1e-4, atol=1e-4)  # the pass is unchanged
    with pytest.raises(ValueError, match="already kept for layers"):
        lm.capture_hidden(None)


def test_layers_the_target_lacks_are_refused(target):
    with pytest.raises(ValueError, match=f"has {LAYERS} decoder layers: no layer \\[{LAYERS}\\]"):
        wrap(target).capture_hidden([2, LAYERS])


# --------------------------------------------------------------------------- lossless, every layout


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("backend", [wrap, wrap_static], ids=["dynamic", "static"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_published_heads_draft_the_targets_own_greedy_output(tokenizer, target, tmp_path, name, backend, tree):
    layout, write = LAYOUTS[name]
    drafter = load(layout, write(tmp_path / name, target), target)
    decoder = SpeculativeDecoder(backend(target), tokenizer, [2], drafter)
    drafted = 0
    for prompt in PROMPTS:
        ids = encode(tokenizer, prompt)
        events = list(decoder.generate(ids, SamplingConfig(), SpecConfig(k=3, max_new_tokens=24, tree=tree)))
        assert emitted(events) == target_greedy(target, ids)[:24], prompt
        drafted += sum(e.drafted for e in events if isinstance(e, StepEvent))
    assert drafted > 0


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_k_auto_drafts_with_a_published_head(tokenizer, target, tmp_path, tree):
    drafter = load("eagle3", eagle3_folder(tmp_path / "h", target), target)
    decoder = SpeculativeDecoder(wrap(target), tokenizer, [2], drafter)
    for prompt in PROMPTS:
        ids = encode(tokenizer, prompt)
        events = list(decoder.generate(ids, SamplingConfig(), SpecConfig(k="auto", max_new_tokens=24, tree=tree)))
        assert emitted(events) == target_greedy(target, ids)[:24], prompt


@pytest.mark.parametrize(
    "sampling", [SamplingConfig(), SamplingConfig(temperature=0.8, seed=99)], ids=["greedy", "seeded"]
)
@pytest.mark.parametrize("name", ["eagle3-bin", "eagle-bin"])
def test_eagle_chains_picked_on_the_device_give_the_targets_own_output(tokenizer, target, tmp_path, name, sampling):
    """EagleDrafter's device chains (on by default on CUDA): each token picked and fed back
    on the device, the draft read once; the same tokens as the pass-by-pass loop, and so the
    target's own greedy text or seeded sample."""
    layout, write = LAYOUTS[name]
    folder = write(tmp_path / name, target)
    host, device = load(layout, folder, target), load(layout, folder, target)
    assert not host.device_chains  # the CPU default
    device.device_chains = True
    plain = SpeculativeDecoder(wrap(target), tokenizer, [2])
    decoders = [SpeculativeDecoder(wrap(target), tokenizer, [2], d) for d in (host, device)]
    for prompt in PROMPTS:
        ids = encode(tokenizer, prompt)
        want = emitted(plain.generate(ids, sampling, SpecConfig(k=0, max_new_tokens=24)))
        runs = [list(d.generate(ids, sampling, SpecConfig(k=4, max_new_tokens=24))) for d in decoders]
        assert emitted(runs[1]) == emitted(runs[0]) == want, prompt
        steps = [[(e.drafted, e.accepted) for e in run if isinstance(e, StepEvent)] for run in runs]
        assert steps[1] == steps[0], prompt  # the same drafts, cut where the loop stops
    if sampling.seed is not None:  # and the same q, read at the same positions
        context = encode(tokenizer, PROMPTS[0])
        noise = PositionNoise(sampling.seed, target.config.vocab_size)
        drafts = []
        for drafter in (host, device):
            lm = wrap(target)
            lm.capture_hidden(drafter.feature_layers)
            lm.forward(context[:-1])
            drafter.rollback(0)
            drafter.start(context)
            drafter.observe_features(0, lm.last_hidden)
            drafter.stop_confidence = 0.0
            drafts.append(drafter.propose(context, 4, sampling, None, noise))
        assert drafts[1].tokens == drafts[0].tokens
        torch.testing.assert_close(drafts[1].probs, drafts[0].probs)


def test_a_draft_vocabulary_with_gaps_maps_through_d2t(tokenizer, target, tmp_path):
    drafter = load("eagle3", eagle3_folder(tmp_path / "h", target), target)
    assert drafter.vocab.ids.tolist() == draft_ids_with_gaps(target.config.vocab_size, DRAFT_VOCAB).tolist()
    context = encode(tokenizer, "def add(a, b):")
    lm = wrap(target)
    lm.capture_hidden(drafter.feature_layers)
    lm.forward(context[:-1])
    drafter.start(context)
    drafter.observe_features(0, lm.last_hidden)
    draft = drafter.propose(context, 3, SamplingConfig(temperature=1.0), torch.Generator().manual_seed(0))
    outside = torch.ones(target.config.vocab_size, dtype=torch.bool)
    outside[drafter.vocab.ids] = False
    assert draft.probs is not None and float(draft.probs[:, outside].sum()) == 0.0
    assert all(t in set(drafter.vocab.ids.tolist()) for t in draft.tokens)


@pytest.mark.parametrize("name", ["eagle3-bin", "eagle-bin", "medusa-pt"])
def test_seeded_sampling_is_the_targets_own_sample(tokenizer, target, tmp_path, name):
    layout, write = LAYOUTS[name]
    plain = SpeculativeDecoder(wrap(target), tokenizer, [2])
    spec = SpeculativeDecoder(wrap(target), tokenizer, [2], load(layout, write(tmp_path / name, target), target))
    sampling = SamplingConfig(temperature=0.8, seed=99)
    for prompt in PROMPTS:
        ids = encode(tokenizer, prompt)
        want = emitted(plain.generate(ids, sampling, SpecConfig(k=0, max_new_tokens=24)))
        assert emitted(spec.generate(ids, sampling, SpecConfig(k=3, max_new_tokens=24))) == want, prompt


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout, tree, chains",
    [
        ("eagle3", False, False),
        ("eagle3", True, False),
        ("eagle", False, False),
        ("medusa", True, False),
        ("eagle3", False, True),  # tokens picked on the device by inverting q's distribution
    ],
    ids=["eagle3-chain", "eagle3-tree", "eagle-chain", "medusa-tree", "eagle3-device-chain"],
)
def test_published_heads_sample_the_exact_target_distribution(tmp_path, layout, tree, chains, monkeypatch):
    monkeypatch.setattr(decoder_module, "coupled", lambda sampling: False)
    tokenizer = char_tokenizer(ALPHABET)
    vocab = len(tokenizer)
    target = tiny_llama(vocab, seed=5, hidden=16, layers=6, logit_scale=6.0)
    if layout == "eagle3":  # a draft vocabulary without the special ids
        sizes = {**dims(target.config), "W": vocab - 3}
        shapes = {k: v for k, v in EAGLE3_SHAPES.items() if k not in ("d2t", "t2d")}
        folder = write_eagle3(
            tmp_path / "h", target.config, random_tensors(shapes, sizes, 1, scale=1.0), torch.arange(3, vocab)
        )
    else:
        folder = LAYOUTS[f"{layout}-bin" if layout == "eagle" else "medusa-pt"][1](tmp_path / "h", target)
    drafter = load(layout, folder, target)
    if chains:
        drafter.device_chains = True
    decoder = SpeculativeDecoder(wrap(target), tokenizer, [], drafter)
    assert_samples_follow_the_target(decoder, target, tokenizer, tree)


# --------------------------------------------------------------------------- which features, by config


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"eagle_aux_hidden_state_layer_ids": [2, 4, 5]},  # vLLM reads the top-level key as the input of layer i
        {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}},  # SGLang reads this one as layer i's output
        {"target_layer_ids": [1, 3, 4]},  # trainers counting the output of layer i
    ],
    ids=["default", "vllm-entering", "sglang-output-of", "target-layer-ids"],
)
def test_both_layer_id_conventions_select_the_default_features(tokenizer, target, tmp_path, config):
    drafter = load("eagle3", eagle3_folder(tmp_path / "h", target, **config), target)
    assert drafter.feature_layers == default_feature_layers(LAYERS) == (2, 4, 5)
    ids = encode(tokenizer, PROMPTS[1])
    decoder = SpeculativeDecoder(wrap(target), tokenizer, [2], drafter)
    steps = [
        e
        for e in decoder.generate(ids, SamplingConfig(), SpecConfig(k=3, max_new_tokens=16))
        if isinstance(e, StepEvent)
    ]
    default = load("eagle3", eagle3_folder(tmp_path / "d", target), target)
    again = [
        e
        for e in SpeculativeDecoder(wrap(target), tokenizer, [2], default).generate(
            ids, SamplingConfig(), SpecConfig(k=3, max_new_tokens=16)
        )
        if isinstance(e, StepEvent)
    ]
    assert [e.accepted for e in steps] == [e.accepted for e in again]


def test_layer_ids_past_the_target_are_refused(target, tmp_path):
    head = read_head(str(eagle3_folder(tmp_path / "h", target, eagle_aux_hidden_state_layer_ids=[2, 16, 29])), "eagle3")
    with pytest.raises(HeadsMismatch, match=r"it reads target layers \[2, 16, 29\], the target has 8"):
        check_head(head, target.config, "tiny-target")


# --------------------------------------------------------------------------- refusals


def test_a_head_for_another_target_is_refused_by_its_config(tokenizer, target, tmp_path):
    other = tiny_llama(len(tokenizer), seed=3, hidden=64, layers=LAYERS)
    for layout, folder in (
        ("eagle3", eagle3_folder(tmp_path / "e3", other)),
        ("eagle", eagle_folder(tmp_path / "e1", other)),
        ("medusa", medusa_folder(tmp_path / "m", other)),
    ):
        head = read_head(str(folder), layout)
        with pytest.raises(HeadsMismatch, match="hidden size 64, the target's 32") as info:
            check_head(head, target.config, "tiny-target")
        assert "--draft auto" in info.value.hint


def test_a_layout_other_than_asked_names_the_right_one(target, tmp_path):
    folder = eagle_folder(tmp_path / "e1", target)
    with pytest.raises(HeadsMismatch, match="is a EAGLE-1/2 head, not EAGLE-3") as info:
        read_head(str(folder), "eagle3")
    assert info.value.hint == f"use --draft eagle:{folder}"


def test_bin_files_are_never_unpickled_freely(target, tmp_path):
    folder = eagle_folder(tmp_path / "e1", target)
    torch.save({"fc.weight": collections.OrderedDict(evil=print)}, folder / "pytorch_model.bin")
    with pytest.raises(HeadsMismatch, match="cannot be read as a state dict of tensors"):
        read_head(str(folder), "eagle")


def test_weights_that_do_not_fit_the_layout_are_named(target, tmp_path):
    folder = eagle3_folder(tmp_path / "h", target, fmt="safetensors")
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["midlayer.hidden_norm.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(HeadsMismatch, match="lacks midlayer.hidden_norm.weight"):
        load("eagle3", folder, target)


def _broken_target(tokenizer, model, folder):
    """A target folder whose weights cannot be read: a refusal that comes from it came before them."""
    save_model_folder(model, tokenizer, folder)
    (folder / "model.safetensors").write_bytes(b"not weights")
    return folder


def test_the_cli_refuses_a_head_for_another_target_before_any_weights(tokenizer, target, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path / "cache"))
    folder = _broken_target(tokenizer, target, tmp_path / "target")
    other = tiny_llama(len(tokenizer), seed=3, hidden=64, layers=LAYERS)
    head = eagle3_folder(tmp_path / "head", other)
    config = json.loads((head / "config.json").read_text())
    (head / "config.json").write_text(json.dumps({**config, "base_model_name_or_path": "someone/big-model"}))
    result = CliRunner().invoke(app, ["generate", "abc", "--target", str(folder), "--draft", f"eagle3:{head}", *ON_CPU])
    assert result.exit_code == 2
    assert result.stdout == ""
    errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert errors == [
        f"error: EAGLE-3 head {head} is for someone/big-model, not {folder}: hidden size 64, the target's 32"
    ]
    assert "Traceback" not in result.stderr


def test_the_cli_warns_of_a_head_published_for_another_model_whose_shapes_fit(tokenizer, target, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path / "cache"))
    folder = save_model_folder(target, tokenizer, tmp_path / "target")
    head = medusa_folder(tmp_path / "head", target)
    result = CliRunner().invoke(
        app,
        [
            "generate",
            "def add(a, b):\n",
            "--target",
            str(folder),
            "--draft",
            f"medusa:{head}",
            "-n",
            "12",
            "--k",
            "3",
            *ON_CPU,
        ],
    )
    assert result.exit_code == 0, result.stderr
    assert f"warning: Medusa head {head} was published for tiny-target; its shapes fit {folder}" in result.stderr
    ids = encode(tokenizer, "def add(a, b):\n")
    assert result.stdout.rstrip("\n") == tokenizer.decode(target_greedy(target, ids)[:12])


def test_the_cli_says_where_to_get_a_hub_head_when_offline(tokenizer, target, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    folder = save_model_folder(target, tokenizer, tmp_path / "target")
    result = CliRunner().invoke(
        app, ["generate", "abc", "--target", str(folder), "--draft", "eagle3:someone/EAGLE3-head", *ON_CPU]
    )
    assert result.exit_code != 0
    assert "error: cannot download the head someone/EAGLE3-head" in result.stderr
    assert "hf download someone/EAGLE3-head --local-dir DIR" in result.stderr
    assert "Traceback" not in result.stderr


def test_auto_falls_back_when_its_head_cannot_be_fetched(tokenizer, target, tmp_path, monkeypatch):
    """On CUDA auto takes a registered head; where it is not cached and the Hub is out of reach,
    it takes what it takes without heads, before any weights, and says so."""
    import speccli.pipeline as pipeline
    from speccli.models.pairs.drafts import DraftChoice

    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr(pipeline, "choose_device", lambda requested: torch.device("cuda"))
    picks = {
        True: DraftChoice("eagle3:someone/EAGLE3-head", "its registered head"),
        False: DraftChoice("ngram", "prompt lookup"),
    }
    monkeypatch.setattr(pipeline, "choose_draft", lambda name, cuda=False, measured=None, trained=(): picks[cuda])
    monkeypatch.setattr("speccli.calibration.measured_draft_gains", lambda target, device=None: {})  # no GPU to name
    folder = save_model_folder(target, tokenizer, tmp_path / "target")
    result = CliRunner().invoke(app, ["generate", "def add(a, b):\n", "--target", str(folder), "-n", "8", *ON_CPU])
    assert result.exit_code == 0, result.stderr
    assert "draft: eagle3:someone/EAGLE3-head (--draft auto: its registered head)" in result.stderr
    assert "draft: ngram instead (cannot download the head someone/EAGLE3-head" in result.stderr
    assert result.stdout.rstrip("\n") == tokenizer.decode(
        target_greedy(target, encode(tokenizer, "def add(a, b):\n"))[:8]
    )


def test_eagle3_alone_needs_a_registered_head(tokenizer, target, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path / "cache"))
    folder = save_model_folder(target, tokenizer, tmp_path / "target")
    result = CliRunner().invoke(app, ["generate", "abc", "--target", str(folder), "--draft", "eagle3", *ON_CPU])
    assert result.exit_code == 2
    assert f"error: no published eagle3 head is registered for {folder}" in result.stderr
    assert "--draft eagle3:HUB_ID|FOLDER" in result.stderr


# --------------------------------------------------------------------------- the arithmetic, by acceptance

K, NEW = 3, 40
RESIDUAL_SCALE = 10.0


@pytest.fixture(scope="module")
def memorized(tokenizer):
    """A tiny target trained until it continues TEXT as TEXT goes on: its greedy text is
    worth drafting, and its features carry what drafting needs."""
    torch.manual_seed(0)
    target = tiny_llama(len(tokenizer), seed=7, hidden=48, layers=LAYERS, heads=4)
    ids = torch.tensor(encode(tokenizer, TEXT))
    optimizer = torch.optim.Adam(target.parameters(), lr=3e-3)
    windows = torch.Generator().manual_seed(0)
    target.train()
    for _ in range(250):
        starts = torch.randint(0, len(ids) - 65, (8,), generator=windows)
        batch = torch.stack([ids[s : s + 65] for s in starts])
        logits = target(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    target.eval().requires_grad_(False)
    # A real model's residual stream is far larger than what its norms make of it; this one's
    # is made so (every write into it scaled; the norms undo it, so the target is unchanged):
    # features read before a norm are then as wrong here as they are there.
    probe = ids[:64][None]
    before = target(input_ids=probe).logits
    with torch.no_grad():
        target.get_input_embeddings().weight.mul_(RESIDUAL_SCALE)
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.mul_(RESIDUAL_SCALE)
            layer.mlp.down_proj.weight.mul_(RESIDUAL_SCALE)
    after = target(input_ids=probe).logits
    torch.testing.assert_close(after, before, rtol=1e-2, atol=1e-2)
    assert torch.equal(after.argmax(-1), before.argmax(-1))
    prompts = [encode(tokenizer, TEXT[i : i + 10]) for i in range(3, 400, 41)]
    return target, ids, prompts


def _windows(ids, steps, seed=1):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        start = int(torch.randint(0, len(ids) - 65, (1,), generator=generator))
        yield ids[start : start + 64]


def _argmax_labels(target, window):
    with torch.no_grad():
        return target(input_ids=window[None]).logits[0].argmax(-1)


def _specgen_acceptance(tokenizer, target, drafter, prompts):
    decoder = SpeculativeDecoder(wrap(target), tokenizer, [], drafter)
    steps = [
        e
        for p in prompts
        for e in decoder.generate(p, SamplingConfig(), SpecConfig(k=K, max_new_tokens=NEW))
        if isinstance(e, StepEvent)
    ]
    return sum(e.accepted for e in steps) / len(steps)


def test_a_trained_eagle3_head_accepts_as_its_reference_does(tokenizer, memorized, tmp_path):
    target, ids, prompts = memorized
    config, layers = target.config, default_feature_layers(LAYERS)
    draft_ids = torch.unique(ids)  # the text's own ids: a draft vocabulary smaller than the target's
    index = torch.full((config.vocab_size,), ref.IGNORE)
    index[draft_ids] = torch.arange(len(draft_ids))
    w = ref.eagle3_init(config.hidden_size, config.intermediate_size, 4, 2, len(draft_ids), seed=1)
    optimizer = torch.optim.Adam(list(w.values()), lr=3e-3)
    embed = target.get_input_embeddings()
    for window in _windows(ids, 300):
        features, labels = ref.layer_inputs(target, window, layers), index[_argmax_labels(target, window)]
        h = ref.eagle3_forward(w, features[:-1], embed(window[1:]), 4, 2)  # row j: feature j, token j + 1
        h2 = ref.eagle3_forward(w, h[:-1], embed(window[2:]), 4, 2)  # a second step reads its own output
        loss = torch.nn.functional.cross_entropy(
            ref.eagle3_logits(w, h), labels[1:], ignore_index=ref.IGNORE
        ) + 0.5 * torch.nn.functional.cross_entropy(ref.eagle3_logits(w, h2), labels[2:], ignore_index=ref.IGNORE)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    w = {k: v.detach() for k, v in w.items()}

    def reference(feature_layers, swapped=False):
        def draft(context):
            features = list(ref.layer_inputs(target, context[:-1], feature_layers))
            embeddings = list(embed(torch.tensor(context[1:])))
            tokens = []
            with torch.no_grad():
                for _ in range(K):
                    h = ref.eagle3_forward(w, features, torch.stack(embeddings), 4, 2, swapped)[-1]
                    tokens.append(int(draft_ids[ref.eagle3_logits(w, h).argmax()]))
                    features.append(h)
                    embeddings.append(embed(torch.tensor(tokens[-1])))
            return tokens

        return ref.acceptance(target, prompts, K, NEW, draft)

    folder = write_eagle3(tmp_path / "head", config, w, draft_ids)
    specgen = _specgen_acceptance(tokenizer, target, load("eagle3", folder, target), prompts)
    right = reference(layers)
    wrong = {"embedding as features": reference((0, 0, 0)), "concatenation swapped": reference(layers, swapped=True)}
    assert abs(specgen - right) < 0.2, (specgen, right)
    assert right > 1.5, right
    assert all(specgen > 2 * value for value in wrong.values()), (specgen, wrong)


def test_a_trained_eagle_head_accepts_as_its_reference_does(tokenizer, memorized, tmp_path):
    target, ids, prompts = memorized
    config = target.config
    w = ref.eagle_init(config.hidden_size, config.intermediate_size, 4, 2, seed=2)
    optimizer = torch.optim.Adam(list(w.values()), lr=3e-3)
    embed, rows = target.get_input_embeddings(), target.lm_head.weight
    for window in _windows(ids, 300):
        features, labels = ref.final_features(target, window), _argmax_labels(target, window)
        h = ref.eagle_forward(w, features[:-1], embed(window[1:]), 4, 2)
        h2 = ref.eagle_forward(w, h[:-1], embed(window[2:]), 4, 2)
        loss = (
            torch.nn.functional.cross_entropy(h @ rows.T, labels[1:])
            + 0.5 * torch.nn.functional.cross_entropy(h2 @ rows.T, labels[2:])
            + torch.nn.functional.smooth_l1_loss(h, features[1:])
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    w = {k: v.detach() for k, v in w.items()}

    def reference(before_norm=False, swapped=False):
        def draft(context):
            features = list(ref.final_features(target, context[:-1], before_norm))
            embeddings = list(embed(torch.tensor(context[1:])))
            tokens = []
            with torch.no_grad():
                for _ in range(K):
                    h = ref.eagle_forward(w, features, torch.stack(embeddings), 4, 2, swapped)[-1]
                    tokens.append(int((h @ rows.T).argmax()))
                    features.append(h)
                    embeddings.append(embed(torch.tensor(tokens[-1])))
            return tokens

        return ref.acceptance(target, prompts, K, NEW, draft)

    folder = write_eagle(tmp_path / "head", config, w)
    specgen = _specgen_acceptance(tokenizer, target, load("eagle", folder, target), prompts)
    right = reference()
    wrong = {"feature before the norm": reference(before_norm=True), "concatenation swapped": reference(swapped=True)}
    assert abs(specgen - right) < 0.2, (specgen, right)
    assert right > 1.5, right
    assert all(specgen > 2 * value for value in wrong.values()), (specgen, wrong)


def test_a_trained_medusa_head_accepts_as_its_reference_does(tokenizer, memorized, tmp_path):
    target, ids, prompts = memorized
    heads = K
    w = ref.medusa_init(target.config.hidden_size, target.lm_head.weight.detach(), heads, seed=3)
    optimizer = torch.optim.Adam(list(w.values()), lr=3e-3)
    for window in _windows(ids, 200):
        features, labels = ref.final_features(target, window), _argmax_labels(target, window)
        # head h on the feature of p: the token at p + h + 2, which is the target's argmax at p + h + 1
        loss = sum(
            torch.nn.functional.cross_entropy(ref.medusa_logits(w, features[: -(h + 1)], h), labels[h + 1 :])
            for h in range(heads)
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    w = {k: v.detach() for k, v in w.items()}

    def reference(off_by_one=False):
        def draft(context):
            # The last settled feature is the one before the pending token's; one off reads the pending one's.
            feature = ref.final_features(target, context if off_by_one else context[:-1])[-1]
            with torch.no_grad():
                return [int(ref.medusa_logits(w, feature, h).argmax()) for h in range(heads)]

        return ref.acceptance(target, prompts, K, NEW, draft)

    folder = write_medusa(tmp_path / "head", w, heads, 1)
    specgen = _specgen_acceptance(tokenizer, target, load("medusa", folder, target), prompts)
    right, wrong = reference(), reference(off_by_one=True)
    assert abs(specgen - right) < 0.2, (specgen, right)
    assert right > 1.0, right
    assert specgen > 2 * wrong, (specgen, wrong)
