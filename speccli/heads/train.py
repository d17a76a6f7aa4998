"""Training Medusa heads and the EAGLE head on features of the frozen target
(speccli.heads.features): self-distillation, the labels being the target's own greedy
predictions. A checkpoint is written every minute and on Ctrl-C; the same command resumes
from it. Accuracy is measured on held-out segments."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch import nn

from speccli.drafters.eagle_layer import EagleHead, additive_mask
from speccli.heads.features import Features
from speccli.drafters.medusa_heads import MedusaHeads
from speccli.heads.store import Heads
from speccli.drafters.draft_vocab import IGNORE, DraftVocab

CHECKPOINT_SECONDS = 60.0
MEDUSA_DECAY = 0.8  # head i's loss weighs 0.8^i (Medusa-1)
EAGLE_CLASSIFICATION_WEIGHT = 0.1  # EAGLE-1: L = L_reg + 0.1 L_cls
EAGLE_NOISE = 0.1  # uniform noise on input features, as a share of their RMS (EAGLE-1 adds U(-0.1, 0.1))
EAGLE_MEASURED_DEPTHS = 3  # held-out accuracy of EAGLE's first three drafted tokens
EAGLE_DEEPER_WEIGHT = 1.0  # loss weight of each unrolled step past the first (training-time test)
WARMUP_STEPS = 20

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass(frozen=True)
class TrainConfig:
    kind: str  # medusa or eagle
    heads: int = 4  # Medusa
    layers: int = 1  # Medusa: residual blocks per head
    vocab: int = 8192  # draft vocabulary size
    epochs: float = 4.0
    batch_segments: int = 8
    learning_rate: float = 1e-3
    seed: int = 0
    bf16: bool = False  # autocast the head's matmuls to bfloat16 (CPUs with native bf16, GPUs)
    eagle_steps: int = 1  # EAGLE: drafting steps unrolled in training (training-time test, EAGLE-3)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class TrainProgress:
    step: int
    steps: int
    loss: float | None
    seconds: float


class Trainer:
    def __init__(
        self,
        config: TrainConfig,
        target: PreTrainedModel,
        train: Features,
        held_out: Features,
        checkpoint: Path,
        progress: Callable[[TrainProgress], None] | None = None,
        vocab_fill: torch.Tensor | None = None,
    ) -> None:
        """`vocab_fill`: token ids of more text, to fill the draft vocabulary where the
        training labels hold fewer distinct ids than `config.vocab` (DraftVocab.most_frequent)."""
        if config.kind not in ("medusa", "eagle"):
            raise ValueError(f"unknown kind of heads: {config.kind}")
        if len(train) == 0:
            raise ValueError("no training segments")
        self.config = config
        self.target = target
        self.train_set = train
        self.held_out = held_out
        self.checkpoint = Path(checkpoint)
        self.progress = progress
        torch.manual_seed(config.seed)
        vocab_size = int(target.get_output_embeddings().weight.shape[0])
        self.vocab = DraftVocab.most_frequent(train.labels, config.vocab, vocab_size, fill=vocab_fill)
        with torch.no_grad():
            self.rows = target.get_output_embeddings().weight.detach()[self.vocab.ids].float()
        self.train_labels = self.vocab.index_of(train.labels)
        if config.kind == "medusa":
            self.module: MedusaHeads | EagleHead = MedusaHeads(
                target.config.hidden_size, len(self.vocab), config.heads, config.layers
            )
            self.module.init_output(self.rows)
        else:
            self.module = EagleHead(target.config)
            try:
                self.module.init_from_target(target)
            except (RuntimeError, KeyError, AttributeError):
                pass  # a layout (or quantized layers) it cannot copy from: start from random weights
            self.embeddings = target.get_input_embeddings()
            self.rms = float(train.features[:64].float().pow(2).mean().sqrt()) or 1.0
        self.module.float().train()
        params = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=0.0)
        per_epoch = math.ceil(len(train) / config.batch_segments)
        self.steps = max(1, math.ceil(config.epochs * per_epoch))
        self.per_epoch = per_epoch
        self.step = 0
        self.seconds = 0.0
        self.losses: list[float] = []
        self.resumed_from = 0

    # ------------------------------------------------------------------ checkpoints

    def _identity(self) -> dict:
        return {"config": self.config.as_dict(), "segments": len(self.train_set), "vocab": self.vocab.ids.tolist()[:64]}

    def resume(self) -> bool:
        """Continue from the checkpoint when it is this run's; True when it did."""
        if not self.checkpoint.exists():
            return False
        try:
            state = torch.load(self.checkpoint, map_location="cpu", weights_only=False)
        except Exception:  # noqa: BLE001 - a damaged checkpoint: start over
            return False
        if state.get("identity") != self._identity():
            return False
        self.module.load_state_dict(state["module"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.seconds, self.losses = state["step"], state["seconds"], state["losses"]
        self.resumed_from = self.step
        return True

    def save_checkpoint(self) -> None:
        self.checkpoint.parent.mkdir(parents=True, exist_ok=True)
        partial = self.checkpoint.with_name(self.checkpoint.name + ".partial")
        torch.save(
            {
                "identity": self._identity(),
                "module": self.module.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "step": self.step,
                "seconds": self.seconds,
                "losses": self.losses,
            },
            partial,
        )
        partial.replace(self.checkpoint)

    # ------------------------------------------------------------------ training

    def _batch(self, step: int) -> torch.Tensor:
        epoch, index = divmod(step, self.per_epoch)
        order = torch.randperm(
            len(self.train_set), generator=torch.Generator().manual_seed(self.config.seed * 1000 + epoch)
        )
        size = self.config.batch_segments
        return order[index * size : (index + 1) * size]

    def _learning_rate(self, step: int) -> float:
        base = self.config.learning_rate
        if step < WARMUP_STEPS:
            return base * (step + 1) / WARMUP_STEPS
        progress = (step - WARMUP_STEPS) / max(1, self.steps - WARMUP_STEPS)
        return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))

    def _autocast(self):
        device = self.train_set.features.device.type
        return torch.autocast(device, dtype=torch.bfloat16, enabled=self.config.bf16)

    def loss(self, batch: torch.Tensor, step: int) -> torch.Tensor:
        features = self.train_set.features[batch].float()
        labels = self.train_labels[batch]
        if isinstance(self.module, MedusaHeads):  # config.kind "medusa"
            return medusa_loss(self.module, features, labels)
        noise = torch.rand(features[:, :-1].shape, generator=torch.Generator().manual_seed(step)) * 2 - 1
        tokens = self.train_set.tokens[batch]
        return eagle_loss(
            self.module,
            self.embeddings,
            self.rows,
            features,
            tokens,
            labels,
            self.rms,
            noise * EAGLE_NOISE * self.rms,
            self.config.eagle_steps,
        )

    def run(self) -> None:
        """Train up to the configured steps; a checkpoint every CHECKPOINT_SECONDS and on Ctrl-C."""
        last_saved = time.perf_counter()
        window: list[float] = []
        tenth = max(1, self.steps // 10)
        try:
            while self.step < self.steps:
                started = time.perf_counter()
                for group in self.optimizer.param_groups:
                    group["lr"] = self._learning_rate(self.step)
                with self._autocast():
                    loss = self.loss(self._batch(self.step), self.step)
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.module.parameters(), 1.0)
                self.optimizer.step()
                self.step += 1
                self.seconds += time.perf_counter() - started
                value = float(loss.detach())
                window.append(value)
                if len(window) == tenth or self.step == self.steps:
                    self.losses.append(sum(window) / len(window))
                    window = []
                if self.progress is not None:
                    self.progress(TrainProgress(self.step, self.steps, value, self.seconds))
                if time.perf_counter() - last_saved > CHECKPOINT_SECONDS:
                    self.save_checkpoint()
                    last_saved = time.perf_counter()
        except KeyboardInterrupt:
            self.save_checkpoint()
            raise

    # ------------------------------------------------------------------ results

    @torch.no_grad()
    def accuracy(self) -> list[float]:
        """Held-out top-1: Medusa head i against the target's token i + 1 places past its
        own next one; EAGLE's drafted token at depth d where the d - 1 before it were
        right (the first from the target's true features, as in decoding)."""
        self.module.eval()
        data = self.held_out
        if len(data) == 0:
            return []
        hits: list[float] = []
        totals: list[int] = []
        for first in range(0, len(data), self.config.batch_segments):
            part = slice(first, first + self.config.batch_segments)
            features, labels = data.features[part].float(), data.labels[part]
            with self._autocast():
                if isinstance(self.module, MedusaHeads):  # config.kind "medusa"
                    logits = self.module(features)  # [K, B, T, V]
                    for i in range(logits.shape[0]):
                        shift = i + 1
                        guess = self.vocab.ids[logits[i, :, :-shift].argmax(-1)]
                        _add(hits, totals, i, (guess == labels[:, shift:]).sum().item(), guess.numel())
                else:
                    guesses = eagle_guesses(
                        self.module,
                        self.embeddings,
                        self.rows,
                        self.vocab,
                        features,
                        data.tokens[part],
                        EAGLE_MEASURED_DEPTHS,
                    )
                    for depth, (hit, total) in enumerate(chain_hits(guesses, labels[:, 1:])):
                        _add(hits, totals, depth, hit, total)
        self.module.train()
        return [h / t for h, t in zip(hits, totals) if t]

    def heads(self, target_identity: dict, training: dict) -> Heads:
        shape = {"heads": self.config.heads, "layers": self.config.layers} if self.config.kind == "medusa" else {}
        module = self.module.eval()
        return Heads(self.config.kind, module, self.vocab, target_identity, shape, training)


def _add(hits: list[float], totals: list[int], index: int, hit: float, total: int) -> None:
    while len(hits) <= index:
        hits.append(0.0)
        totals.append(0)
    hits[index] += hit
    totals[index] += total


def medusa_loss(module: MedusaHeads, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum over heads of MEDUSA_DECAY^i x cross-entropy; head i (from 0) at position t is
    scored against the target's prediction at t + i + 1 (labels: draft-vocabulary indices)."""
    logits = module(features)  # [K, B, T, V]
    total = logits.new_zeros((), dtype=torch.float32)
    for i in range(logits.shape[0]):
        shift = i + 1
        if shift >= features.shape[1]:
            break
        scores = logits[i, :, :-shift].reshape(-1, logits.shape[-1]).float()
        targets = labels[:, shift:].reshape(-1)
        if (targets != IGNORE).any():
            total = total + MEDUSA_DECAY**i * F.cross_entropy(scores, targets, ignore_index=IGNORE)
    return total


def unrolled_attention(length: int, steps: int) -> torch.Tensor:
    """What each entry of `steps` unrolled drafting steps sees, as bool [steps * length,
    steps * length] (True: attends). Entry (s, t), s from 1, stands for the token drafted at
    depth s whose ancestors were right: like a tree node in decoding it sees the entries fed
    real features up to position t - s + 1 and its ancestors, (j, t - s + j) for 1 < j <= s."""
    step = torch.arange(steps).repeat_interleave(length)[:, None] + 1  # s of each row
    position = torch.arange(length).repeat(steps)[:, None]  # t of each row
    key_step, key_position = step.T, position.T
    real = (key_step == 1) & (key_position <= position - step + 1)
    ancestor = (key_step > 1) & (key_step <= step) & (key_position == position - step + key_step)
    return real | ancestor


def eagle_unrolled(
    head: EagleHead,
    embeddings: nn.Module,
    features: torch.Tensor,
    tokens: torch.Tensor,
    steps: int,
    noise: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """Teacher forcing unrolled over `steps` drafting steps (EAGLE-3's training-time test):
    step 1 reads (feature t, embedding of token t + 1) for t < T - 1; step s reads
    the feature step s - 1 predicted for position t instead, as decoding at depth s does.
    Returns each step's predicted features of positions 1 .. T - 1 [B, T - 1, hidden]; step
    s's first s - 1 have no such input and are not meaningful. Each step is one pass of the
    head over T - 1 entries, attending to the earlier steps' entries through a cache."""
    from transformers import DynamicCache

    length = features.shape[1] - 1
    inputs = features[:, :-1] if noise is None else features[:, :-1] + noise
    weight = embeddings.weight
    assert isinstance(weight, torch.Tensor), "an input embedding has a weight"
    with torch.no_grad():
        embedded = embeddings(tokens[:, 1:].to(weight.device)).float()
    positions = torch.arange(length).expand(features.shape[0], -1)
    if steps == 1:
        return [head(inputs, embedded, positions)]
    cache = DynamicCache(config=head.body.config)
    outputs = [head(inputs, embedded, positions, cache=cache)]
    seen = unrolled_attention(length, steps)
    for step in range(2, steps + 1):
        # Step s at t reads what step s - 1 predicted at t - 1 (position 0 keeps its own input: not scored).
        fed = torch.cat([inputs[:, :1], outputs[-1][:, :-1]], dim=1)
        rows = seen[(step - 1) * length : step * length, : step * length]
        outputs.append(head(fed, embedded, positions, cache=cache, attention_mask=additive_mask(rows, inputs.dtype)))
    return outputs


def eagle_guesses(
    head: EagleHead,
    embeddings: nn.Module,
    rows: torch.Tensor,
    vocab: DraftVocab,
    features: torch.Tensor,
    tokens: torch.Tensor,
    depths: int = 1,
) -> list[torch.Tensor]:
    """Teacher forcing: the head's drafted tokens (target ids) for positions 2 .. T [B, T - 1],
    at each depth up to `depths` (eagle_unrolled), from the target's true features and
    tokens; `rows` are the target's output rows for the draft vocabulary."""
    return [
        vocab.ids[(out.float() @ rows.float().T).argmax(-1)]
        for out in eagle_unrolled(head, embeddings, features, tokens, depths)
    ]


def eagle_first_guesses(
    head: EagleHead,
    embeddings: nn.Module,
    rows: torch.Tensor,
    vocab: DraftVocab,
    features: torch.Tensor,
    tokens: torch.Tensor,
) -> torch.Tensor:
    """The first drafted tokens (eagle_guesses at depth 1)."""
    return eagle_guesses(head, embeddings, rows, vocab, features, tokens)[0]


def chain_hits(guesses: list[torch.Tensor], labels: torch.Tensor) -> list[tuple[int, int]]:
    """(hits, chances) per depth: the guess at depth d for position t (guesses[d - 1][:, t])
    counts where the d - 1 guesses of its chain, (j, t - d + j), were all right."""
    right = [guess == labels for guess in guesses]
    result = []
    for depth, hit in enumerate(right, start=1):
        chance = torch.ones_like(hit)
        chance[:, : depth - 1] = False
        for j in range(1, depth):
            shift = depth - j
            chance[:, shift:] &= right[j - 1][:, :-shift]
        result.append((int((hit & chance).sum()), int(chance.sum())))
    return result


def eagle_loss(
    head: EagleHead,
    embeddings: nn.Module,
    rows: torch.Tensor,
    features: torch.Tensor,
    tokens: torch.Tensor,
    labels: torch.Tensor,
    rms: float,
    noise: torch.Tensor | None = None,
    steps: int = 1,
) -> torch.Tensor:
    """EAGLE-1: smooth L1 between predicted and true features (in units of their RMS) plus
    EAGLE_CLASSIFICATION_WEIGHT x cross-entropy of the token the target would say next;
    with `steps` > 1, the same for each unrolled step (EAGLE_DEEPER_WEIGHT each)."""
    total = features.new_zeros((), dtype=torch.float32)
    for index, predicted in enumerate(eagle_unrolled(head, embeddings, features, tokens, steps, noise)):
        scored = slice(index, None)  # step s's first s - 1 positions had no input of their own
        predicted = predicted[:, scored]
        regression = F.smooth_l1_loss(predicted.float() / rms, features[:, 1:][:, scored] / rms)
        scores = (predicted @ rows.T.to(predicted.dtype)).float().reshape(-1, rows.shape[0])
        targets = labels[:, 1:][:, scored].reshape(-1)
        classification = (
            F.cross_entropy(scores, targets, ignore_index=IGNORE) if (targets != IGNORE).any() else scores.sum() * 0
        )
        total = total + (1.0 if index == 0 else EAGLE_DEEPER_WEIGHT) * (
            regression + EAGLE_CLASSIFICATION_WEIGHT * classification
        )
    return total
