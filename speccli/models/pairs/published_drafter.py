"""A published head (speccli.models.pairs.published_heads), checked against its target, built into the
drafter that drafts with it: the weights renamed from the published layout into specgen's
modules, the draft vocabulary from `d2t`, the features the head reads."""

from __future__ import annotations

import re
from typing import Any, cast

import torch
from torch import nn

from speccli.backends.base import FeatureLM
from speccli.drafters.base import Drafter
from speccli.drafters.draft_vocab import DraftVocab
from speccli.drafters.eagle3_layer import Eagle3Head
from speccli.drafters.eagle_layer import EagleHead, OutputRows
from speccli.drafters.heads import EagleDrafter, MedusaDrafter
from speccli.drafters.medusa_heads import MedusaHeads
from speccli.drafters.model import DEFAULT_STOP_CONFIDENCE
from speccli.models.errors import HeadsMismatch
from speccli.models.pairs.published_heads import PublishedHead

# Config keys an EAGLE-3 layer is built from; anything else in a head's config is not read.
LAYER_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "hidden_act",
    "max_position_embeddings",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "attention_bias",
    "mlp_bias",
    "vocab_size",
    "draft_vocab_size",
    "target_hidden_size",
    "norm_before_residual",
)


def published_drafter(head: PublishedHead, target: FeatureLM, config: Any, dtype: torch.dtype | None = None) -> Drafter:
    """The drafter for `head` over the target behind `target` (its transformers `config`),
    already checked by `check_head`. The target's embedding (and for EAGLE-1/2 its output
    rows) come from the backend, whole even where the target is split over processes."""
    embeddings = target.input_embedding()
    weight = cast(torch.Tensor, embeddings.weight)  # an embedding's weight (nn.Module's attributes are untyped)
    if dtype is None:
        dtype = weight.dtype if weight.dtype.is_floating_point else torch.float32
    device = weight.device
    tensors = head.tensors()
    logits_width = target.vocab_size  # the target's logits: its output rows (a padded vocabulary included)
    if head.layout == "medusa":
        medusa = medusa_module(tensors, head.source)
        first_out = medusa.out[0]
        assert isinstance(first_out, nn.Linear)  # MedusaHeads' output layers are Linear
        vocab = DraftVocab(torch.arange(first_out.out_features), logits_width)
        return MedusaDrafter(medusa.to(device), vocab, dtype)
    if head.layout == "eagle":
        eagle = eagle_module(tensors, head, config)
        vocab = DraftVocab(torch.arange(logits_width), logits_width)
        rows = OutputRows(target.output_rows())
        return EagleDrafter(eagle.to(device), vocab, embeddings, rows, DEFAULT_STOP_CONFIDENCE, dtype)
    eagle3, vocab = eagle3_module(tensors, head, logits_width)
    eagle3.to(device)
    output = nn.Sequential(eagle3.norm, eagle3.lm_head)
    layers = head.feature_layers(config.num_hidden_layers)
    return EagleDrafter(eagle3, vocab, embeddings, output, DEFAULT_STOP_CONFIDENCE, dtype, feature_layers=layers)


def _load(module: nn.Module, weights: dict[str, torch.Tensor], source: str, ignore: tuple[str, ...] = ()) -> None:
    """Load exactly the module's weights: a missing, extra or misshapen tensor is a HeadsMismatch."""
    expected = {k: v for k, v in module.state_dict().items() if not k.startswith(ignore)}
    weights = {k: v for k, v in weights.items() if not k.startswith(ignore)}
    missing = [k for k in expected if k not in weights]
    extra = [k for k in weights if k not in expected]
    wrong = [
        f"{k} {list(v.shape)} (expected {list(expected[k].shape)})"
        for k, v in weights.items()
        if k in expected and v.shape != expected[k].shape
    ]
    if missing or extra or wrong:
        parts = [
            f"lacks {', '.join(missing[:3])}" if missing else "",
            f"has unexpected {', '.join(extra[:3])}" if extra else "",
            f"has {', '.join(wrong[:2])}" if wrong else "",
        ]
        raise HeadsMismatch(f"{source}: its weights do not fit the layout: {'; '.join(p for p in parts if p)}")
    module.load_state_dict(weights, strict=False)


def medusa_module(tensors: dict[str, torch.Tensor], source: str) -> MedusaHeads:
    """Medusa's `{h}.{l}.linear.*` / `{h}.{layers}.weight` as MedusaHeads (the count of heads
    and of layers read from the keys, not assumed)."""
    blocks = [tuple(map(int, m.groups())) for k in tensors if (m := re.fullmatch(r"(\d+)\.(\d+)\.linear\.weight", k))]
    if not blocks:
        raise HeadsMismatch(f"{source}: no Medusa heads in its weights (no 0.0.linear.weight)")
    heads = 1 + max(h for h, _ in blocks)
    layers = 1 + max(layer for _, layer in blocks)
    hidden = tensors["0.0.linear.weight"].shape[0]
    out_key = f"0.{layers}.weight"
    if out_key not in tensors:
        raise HeadsMismatch(f"{source}: Medusa head 0 lacks its output layer ({out_key})")
    module = MedusaHeads(hidden, tensors[out_key].shape[0], heads, layers)
    renamed = {}
    for key, value in tensors.items():
        h, rest = key.split(".", 1)
        index, _, tail = rest.partition(".")
        if tail.startswith("linear."):
            renamed[f"blocks.{h}.{index}.{tail}"] = value
        else:
            renamed[f"out.{h}.{tail}"] = value
    _load(module, renamed, source)
    return module


def eagle_module(tensors: dict[str, torch.Tensor], head: PublishedHead, config: Any) -> EagleHead:
    """An EAGLE-1/2 head as specgen's EagleHead, without the norms the published layer lacks."""
    module = EagleHead(config, fc_bias="fc.bias" in tensors).without_input_norms()
    renamed = {("body." + k if k.startswith("layers.") else k): v for k, v in tensors.items()}
    _load(module, renamed, head.source, ignore=("embed_tokens.", "body.embed_tokens."))
    return module


def eagle3_module(
    tensors: dict[str, torch.Tensor], head: PublishedHead, target_vocab: int
) -> tuple[Eagle3Head, DraftVocab]:
    """An EAGLE-3 head and its draft vocabulary (target id = draft id + d2t[draft id])."""
    from transformers import LlamaConfig

    settings = {k: v for k, v in head.layer_config.items() if k in LAYER_KEYS}
    settings.setdefault("draft_vocab_size", settings.get("vocab_size", target_vocab))
    config = LlamaConfig(**settings)
    module = Eagle3Head(config)
    weights = {re.sub(r"^layers\.0\.", "midlayer.", k): v for k, v in tensors.items()}
    d2t = weights.pop("d2t", None)
    weights.pop("t2d", None)
    _load(module, weights, head.source, ignore=("embed_tokens.",))
    draft_size = module.lm_head.out_features
    ids = torch.arange(draft_size)
    if d2t is not None:
        if d2t.shape != (draft_size,):
            raise HeadsMismatch(f"{head.source}: d2t has {list(d2t.shape)} entries, its output layer {draft_size}")
        ids = ids + d2t.long()
    try:
        vocab = DraftVocab(ids, target_vocab)
    except ValueError as error:
        raise HeadsMismatch(f"{head.source}: its d2t does not map into the target's vocabulary ({error})") from None
    return module, vocab
