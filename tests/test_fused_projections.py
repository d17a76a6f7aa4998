"""q/k/v and gate/up fused into one product each (speccli.backends.fused): the same logits as
the model before (float32), the same greedy text through the decoder and both backends,
through torch.compile too; quantized, unknown and already-fused layers left alone."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from conftest import tiny_llama, wrap, wrap_static
from speccli.config import SamplingConfig, SpecConfig
from speccli.drafters.model import ModelDrafter
from speccli.loop import SpeculativeDecoder
from speccli.models.kernels.int8 import quantize_int8
from speccli.backends.fused import FusedGatedMLP, ProjectionPart, StackedProjection, fuse_projections
from speccli.models.loading import LoadedModel, fused_on_load
from speccli.models.names.registry import ResolvedModel
from test_decoder_greedy import EOS, MAX_NEW, PROMPTS, emitted, encode, target_greedy

IDS = torch.tensor([[1, 7, 3, 12, 40, 9, 22, 5]])


@pytest.fixture()
def model():
    return tiny_llama(64, seed=3, logit_scale=3.0)


def test_fused_layers_give_the_same_logits(model):
    before = copy.deepcopy(model)
    assert fuse_projections(model) == 2
    layer = model.model.layers[0]
    assert isinstance(layer.mlp, FusedGatedMLP) and isinstance(layer.self_attn.q_proj, ProjectionPart)
    assert layer.mlp.gate_up.weight.shape == (2 * 64, 32)  # intermediate 64 twice, hidden 32
    assert layer.self_attn.stacked_qkv.stacked.weight.shape == (32 + 16 + 16, 32)  # 4 heads, 2 key/value heads of 8
    with torch.inference_mode():
        torch.testing.assert_close(model(IDS).logits, before(IDS).logits, rtol=1e-5, atol=1e-5)
    # Each weight is held once: the stacked ones replace the parts.
    names = {name for name, _ in model.named_parameters()}
    assert not any(name.endswith(("q_proj.weight", "gate_proj.weight", "up_proj.weight")) for name in names)


def test_biased_qkv_projections_fuse_too():
    """Qwen2's q, k and v projections carry biases (stacked with their rows)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(4)
    config = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    qwen = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in qwen.model.layers:
            for name in ("q_proj", "k_proj", "v_proj"):
                getattr(layer.self_attn, name).bias.normal_()
    before = copy.deepcopy(qwen)
    assert fuse_projections(qwen) == 2
    assert qwen.model.layers[1].self_attn.stacked_qkv.stacked.bias.shape == (32 + 16 + 16,)
    with torch.inference_mode():
        torch.testing.assert_close(qwen(IDS).logits, before(IDS).logits, rtol=1e-5, atol=1e-5)


def test_fusing_twice_changes_nothing(model):
    assert fuse_projections(model) == 2
    assert fuse_projections(model) == 0


@pytest.mark.parametrize("backend", [wrap, wrap_static], ids=["dynamic", "static"])
def test_a_fused_pair_decodes_the_unfused_targets_greedy_text(pairs, tokenizer, backend):
    pair = pairs[0]
    target, draft = copy.deepcopy(pair.target), copy.deepcopy(pair.draft)
    assert fuse_projections(target) and fuse_projections(draft)
    decoder = SpeculativeDecoder(backend(target), tokenizer, [EOS], ModelDrafter(backend(draft), len(tokenizer)))
    for prompt in PROMPTS:
        ids = encode(tokenizer, prompt)
        for tree in (False, True):
            events = decoder.generate(ids, SamplingConfig(), SpecConfig(k=3, max_new_tokens=MAX_NEW, tree=tree))
            assert emitted(events) == target_greedy(pair.target, ids), (prompt, tree)


def test_parts_asked_in_any_order_or_twice_are_the_parts():
    torch.manual_seed(0)
    linears = [nn.Linear(8, n) for n in (6, 2, 2)]
    stacked = StackedProjection(linears)
    parts = [ProjectionPart(stacked, i) for i in range(3)]
    x, y = torch.randn(1, 3, 8), torch.randn(1, 3, 8)
    with torch.inference_mode():
        for order in ([2, 0, 1], [0, 0, 1, 2], [1, 2]):
            for i in order:
                torch.testing.assert_close(parts[i](x), linears[i](x))
        torch.testing.assert_close(parts[0](y), linears[0](y))  # a new input after an unfinished one
        for i in (1, 0, 2):
            torch.testing.assert_close(parts[i](x), linears[i](x))
        x.add_(1.0)  # the same tensor changed in place: read again once every part was taken
        for i in range(3):
            torch.testing.assert_close(parts[i](x), linears[i](x))


def test_quantized_layers_are_left_alone(model):
    assert fuse_projections(quantize_int8(model)) == 0


class SwappedMLP(nn.Module):
    """gate, up and down, but not down(act(gate(x)) * up(x))."""

    def __init__(self, mlp) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj, self.act_fn = (
            mlp.gate_proj,
            mlp.up_proj,
            mlp.down_proj,
            mlp.act_fn,
        )

    def forward(self, x):
        return self.down_proj(self.gate_proj(x) * self.act_fn(self.up_proj(x)))


def test_an_mlp_of_another_form_is_not_fused(model):
    before = copy.deepcopy(model)
    for layer in model.model.layers:
        layer.mlp = SwappedMLP(layer.mlp)
    for layer in before.model.layers:
        layer.mlp = SwappedMLP(layer.mlp)
    assert fuse_projections(model) == 2  # the attention's projections only
    assert all(isinstance(layer.mlp, SwappedMLP) for layer in model.model.layers)
    with torch.inference_mode():
        torch.testing.assert_close(model(IDS).logits, before(IDS).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_a_fused_model_compiles_to_the_same_logits(model):
    before = copy.deepcopy(model)
    fuse_projections(model)
    compiled = torch.compile(model, dynamic=False)
    with torch.inference_mode():
        torch.testing.assert_close(compiled(IDS).logits, before(IDS).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "device, quant, tp, writing, fused",
    [
        ("cuda", "none", 1, False, True),
        ("cpu", "none", 1, False, False),  # the CPU's own linear kernels (oneDNN, two rows) take the layers
        ("cuda", "int4", 1, False, False),  # quantized weights are not stacked
        ("cuda", "none", 2, False, False),  # layers split over processes
        ("cuda", "none", 1, True, False),  # a conversion being written holds the unfused tensors
    ],
)
def test_models_are_fused_on_load_on_cuda_with_dense_weights(model, device, quant, tp, writing, fused):
    assert fused_on_load(model, torch.device(device), quant, tp, writing=writing) is fused
    assert isinstance(model.model.layers[0].mlp, FusedGatedMLP) is fused


def test_a_fused_model_says_so():
    loaded = LoadedModel(
        name="m",
        resolved=ResolvedModel("local-folder", "m", None, "a folder"),
        model=None,
        tokenizer=None,
        device=torch.device("cuda"),
        dtype=torch.bfloat16,
        quant="none",
        load_seconds=1.0,
        linear="fused",
    )
    assert loaded.describe() == "m: local-folder, bfloat16, q/k/v and gate/up fused on cuda, loaded in 1.0 s"


def test_an_eagle_head_starts_from_a_fused_targets_last_layer_as_from_the_unfused(model):
    from speccli.drafters.eagle_layer import EagleHead
    from speccli.backends.fused import unfused_state_dict

    before = copy.deepcopy(model)
    fuse_projections(model)
    state = unfused_state_dict(model)
    assert state.keys() == before.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in before.state_dict().items())
    heads = []
    for target in (before, model):
        torch.manual_seed(0)
        head = EagleHead(target.config)
        head.init_from_target(target)
        heads.append(head.state_dict())
    assert all(torch.equal(heads[0][k], heads[1][k]) for k in heads[0])
