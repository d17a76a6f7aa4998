"""`specgen train medusa|eagle`: the target loaded, a corpus built, the target's features
extracted (cached on disk, resumable), the heads trained (checkpointed, resumable), measured
on held-out text and saved where `--draft medusa|eagle` finds them."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from speccli.heads.corpus import build_corpus
from speccli.heads.features import extract
from speccli.heads.store import default_heads_path, save_heads, slug, target_identity
from speccli.heads.train import TrainConfig, Trainer, TrainProgress
from speccli.models.loading import LoadedModel, cpu_has_fast_bf16, dtype_name


@dataclass(frozen=True)
class TrainRequest:
    config: TrainConfig
    tokens: int
    data: tuple[Path, ...] = ()
    out: Path | None = None  # the heads file; default: the cache, where --draft finds it


@dataclass
class TrainOutcome:
    path: Path
    training: dict[str, Any]


class TrainEvents:
    """What the command shows while it works (the CLI renders these)."""

    def __init__(
        self,
        say: Callable[[str], None],
        features: Callable[[int, int], None] | None = None,
        steps: Callable[[TrainProgress], None] | None = None,
    ) -> None:
        self.say = say
        self.features = features
        self.steps = steps


def heads_path(request: TrainRequest, cache_dir: Path, target_name: str) -> Path:
    if request.out is None:
        return default_heads_path(cache_dir, target_name, request.config.kind)
    out = Path(request.out)
    return out / f"{request.config.kind}.safetensors" if out.suffix != ".safetensors" else out


def autocast_bf16(target: LoadedModel) -> bool:
    """bfloat16 matmuls for training where they are fast: CUDA, or a CPU with native bf16."""
    if target.device.type == "cuda":
        return True
    return cpu_has_fast_bf16()


def train_heads(target: LoadedModel, request: TrainRequest, cache_dir: Path, events: TrainEvents) -> TrainOutcome:
    started = time.perf_counter()
    identity = target_identity(target.model, target.name)
    path = heads_path(request, cache_dir, target.name)
    corpus = build_corpus(target.tokenizer, request.tokens, request.data)
    events.say(f"corpus: {corpus.tokens} tokens in {len(corpus.segments)} segments ({corpus.description})")
    folder = Path(cache_dir) / "heads" / slug(target.name) / "features" / dtype_name(target.dtype)
    features_started = time.perf_counter()
    features = extract(target.model, corpus, folder, events.features)
    feature_seconds = time.perf_counter() - features_started
    train_index, held_index = corpus.split()
    trainer = Trainer(
        request.config,
        target.model,
        features.select(train_index),
        features.select(held_index),
        path.with_name(path.name + ".checkpoint"),
        events.steps,
    )
    if trainer.resume():
        events.say(f"resuming from step {trainer.step} of {trainer.steps} ({trainer.checkpoint})")
    events.say(
        f"training {request.config.kind}: {trainer.steps} steps over {len(train_index)} segments,"
        f" draft vocabulary {len(trainer.vocab)} ids"
    )
    trainer.run()
    accuracy = trainer.accuracy()
    held_labels = features.select(held_index).labels if held_index else features.labels[:0]
    training = {
        "data": corpus.description,
        "tokens": len(train_index) * len(corpus.segments[0]),
        "held_out_tokens": len(held_index) * len(corpus.segments[0]),
        "epochs": request.config.epochs,
        "steps": trainer.steps,
        "vocab": len(trainer.vocab),
        "vocab_coverage": round(trainer.vocab.coverage(held_labels), 4),
        "accuracy": [round(a, 4) for a in accuracy],
        "feature_seconds": round(feature_seconds, 1),
        "train_seconds": round(trainer.seconds, 1),
        "seconds": round(time.perf_counter() - started, 1),
        "losses": [round(x, 4) for x in trainer.losses],
        "dtype": dtype_name(target.dtype),
        "device": str(target.device),
        "config": request.config.as_dict(),
        "trained": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    heads = trainer.heads(identity, training)
    save_heads(heads, path)
    trainer.checkpoint.unlink(missing_ok=True)
    return TrainOutcome(path, training)


def accuracy_line(kind: str, accuracy: Sequence[float]) -> str:
    if not accuracy:
        return "held-out top-1: no held-out text"
    if kind == "eagle":
        return f"held-out top-1: first token {100 * accuracy[0]:.1f}%"
    return "held-out top-1: " + ", ".join(f"head {i + 1} {100 * a:.1f}%" for i, a in enumerate(accuracy))


def default_config(kind: str, **overrides: Any) -> TrainConfig:
    # Tried on the default target and corpus here: 1e-3 (medusa) and 3e-4 (eagle) learned too slowly in 2-8 epochs.
    rate = 3e-3 if kind == "medusa" else 1e-3
    values = {"kind": kind, "learning_rate": rate, **{k: v for k, v in overrides.items() if v is not None}}
    return TrainConfig(**values)
