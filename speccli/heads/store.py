"""Trained heads on disk: one safetensors file each, holding the weights, the draft
vocabulary and, in its metadata, the kind, the shape, what it was trained on and the
identity of the target it was trained for. A file is refused for any other target."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from speccli.models.errors import HeadsMismatch
from speccli.drafters.eagle_layer import EagleHead
from speccli.drafters.medusa_heads import MedusaHeads
from speccli.drafters.draft_vocab import DraftVocab

FORMAT = "1"
KINDS = ("medusa", "eagle")
# Relative difference of the target's output-row norms above which a file is for another model.
NORM_TOLERANCE = 0.01
SIGNATURE_BLOCKS = 8

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def target_identity(model: PreTrainedModel, name: str, rows: torch.Tensor | None = None) -> dict[str, Any]:
    """What a head depends on: the target's shape, and the norms of its output rows in
    blocks (the same weights in another dtype agree within NORM_TOLERANCE; another model's
    do not). `rows`: those rows whole, where the model is split over processes."""
    config = model.config
    weight = rows if rows is not None else model.get_output_embeddings().weight
    with torch.no_grad():
        norms = [round(float(block.float().norm()), 4) for block in weight.detach().chunk(SIGNATURE_BLOCKS)]
    return {
        "name": name,
        "model_type": getattr(config, "model_type", None),
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
        "vocab_size": int(weight.shape[0]),
        "output_norms": norms,
    }


def identity_problem(saved: dict[str, Any], target: dict[str, Any]) -> str | None:
    """Why heads trained for `saved` cannot serve `target`, or None."""
    for key in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size"):
        if saved.get(key) != target.get(key):
            return f"{key} {saved.get(key)} there, {target.get(key)} here"
    a, b = saved.get("output_norms") or [], target.get("output_norms") or []
    if len(a) != len(b) or any(abs(x - y) > NORM_TOLERANCE * max(abs(x), abs(y), 1e-6) for x, y in zip(a, b)):
        return "its output weights differ"
    return None


@dataclass
class Heads:
    """Loaded (or freshly trained) heads and what is known about them."""

    kind: str
    module: MedusaHeads | EagleHead
    vocab: DraftVocab
    target: dict[str, Any]
    shape: dict[str, Any] = field(default_factory=dict)  # heads/layers for Medusa
    training: dict[str, Any] = field(default_factory=dict)  # tokens, accuracy, seconds, data

    def state(self) -> dict[str, torch.Tensor]:
        module = self.module
        weights = module.trainable_state() if isinstance(module, EagleHead) else module.state_dict()
        return {**{f"head.{k}": v for k, v in weights.items()}, "vocab.ids": self.vocab.ids}


def save_heads(heads: Heads, path: Path) -> Path:
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in heads.state().items()}
    metadata = {
        "format": FORMAT,
        "kind": heads.kind,
        "target": json.dumps(heads.target),
        "shape": json.dumps(heads.shape),
        "training": json.dumps(heads.training),
    }
    partial = path.with_name(path.name + ".partial")
    save_file(tensors, str(partial), metadata=metadata)
    partial.replace(path)
    return path


def read_metadata(path: Path) -> dict[str, Any]:
    """The metadata of a heads file, decoded; HeadsMismatch when it is not one."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            raw = handle.metadata() or {}
    except (OSError, ValueError, RuntimeError, SafetensorError) as error:
        raise HeadsMismatch(f"{path} is not a heads file: {error}") from None
    if raw.get("kind") not in KINDS or raw.get("format") != FORMAT:
        raise HeadsMismatch(f"{path} is not a specgen heads file (format {FORMAT})")
    try:
        return {
            "kind": raw["kind"],
            "target": json.loads(raw["target"]),
            "shape": json.loads(raw.get("shape", "{}")),
            "training": json.loads(raw.get("training", "{}")),
        }
    except (KeyError, ValueError) as error:
        raise HeadsMismatch(f"{path} has damaged metadata: {error}") from None


def load_heads(
    path: Path, target: PreTrainedModel, target_name: str, kind: str | None = None, rows: torch.Tensor | None = None
) -> Heads:
    """The heads in `path`, checked against the target they will draft for (`rows`: its
    output rows whole, where it is split over processes)."""
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise HeadsMismatch(f"no heads file at {path}")
    meta = read_metadata(path)
    if kind is not None and meta["kind"] != kind:
        raise HeadsMismatch(f"{path} holds {meta['kind']} heads, not {kind}")
    here = target_identity(target, target_name, rows)
    problem = identity_problem(meta["target"], here)
    if problem is not None:
        raise HeadsMismatch(
            f"{path} was trained for {meta['target'].get('name')}, not {target_name} ({problem})",
            hint=f"train heads for this target: specgen train {meta['kind']} --target {target_name}",
        )
    tensors = load_file(str(path))
    vocab = DraftVocab(tensors.pop("vocab.ids").long(), here["vocab_size"])
    weights = {k.removeprefix("head."): v for k, v in tensors.items()}
    module = build_module(meta["kind"], target, len(vocab), meta["shape"])
    module.load_state_dict(weights, strict=False)
    missing = [k for k in module.state_dict() if k not in weights and "embed_tokens" not in k]
    if missing:
        raise HeadsMismatch(f"{path} lacks weights: {', '.join(missing[:3])}")
    return Heads(meta["kind"], module.eval(), vocab, meta["target"], meta["shape"], meta["training"])


def build_module(kind: str, target: PreTrainedModel, vocab_size: int, shape: dict[str, Any]) -> MedusaHeads | EagleHead:
    if kind == "medusa":
        return MedusaHeads(
            target.config.hidden_size, vocab_size, int(shape.get("heads", 4)), int(shape.get("layers", 1))
        )
    if kind == "eagle":
        return EagleHead(target.config)
    raise HeadsMismatch(f"unknown kind of heads: {kind} (known: {', '.join(KINDS)})")
