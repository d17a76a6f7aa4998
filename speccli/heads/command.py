"""`specgen train medusa|eagle`: the target loaded, its own answers made (speccli.heads.answers),
a corpus built, the target's features extracted (cached on disk, resumable), the heads
trained (checkpointed, resumable), measured on held-out text and saved where
`--draft medusa|eagle` finds them."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from speccli.heads.answers import ANSWER_TOKENS, Answer, make_answers, read_answers
from speccli.heads.corpus import build_corpus
from speccli.heads.features import extract
from speccli.heads.instructions import requests
from speccli.heads.store import save_heads, target_identity
from speccli.models.names.offline import default_heads_path, slug
from speccli.heads.train import TrainConfig, Trainer, TrainProgress
from speccli.models.loading import LoadedModel, cpu_has_fast_bf16, dtype_name

VOCAB_TEXT_TOKENS = 500_000  # text tokenized (not read by the target) to fill the draft vocabulary


@dataclass(frozen=True)
class TrainRequest:
    config: TrainConfig
    tokens: int
    data: tuple[Path, ...] = ()
    out: Path | None = None  # the heads file; default: the cache, where --draft finds it
    answers: int = 0  # requests the target answers first, to train on its own answers


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
        answers: Callable[[int, int], None] | None = None,
    ) -> None:
        self.say = say
        self.features = features
        self.steps = steps
        self.answers = answers


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
    chats = own_answers(target, request.answers, cache_dir, events) if request.answers else []
    corpus = build_corpus(target.tokenizer, request.tokens, request.data, chats=chats)
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
        vocab_fill=vocabulary_text(target, request, chats),
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


def vocabulary_text(target: LoadedModel, request: TrainRequest, chats: list[list[dict[str, str]]]) -> torch.Tensor:
    """Token ids of the same text continued to VOCAB_TEXT_TOKENS: tokenized only, never read
    by the target, they fill the draft vocabulary past the ids the training labels hold
    (64,000 tokens of answers hold about 5,000 distinct ids; 500,000 of the same text
    about 15,000, and tokenizing them is quick)."""
    if request.tokens >= VOCAB_TEXT_TOKENS:
        return torch.zeros(0, dtype=torch.long)
    corpus = build_corpus(target.tokenizer, VOCAB_TEXT_TOKENS, request.data, chats=chats)
    return torch.tensor([token for segment in corpus.segments for token in segment], dtype=torch.long)


def answers_path(cache_dir: Path, target_name: str) -> Path:
    return Path(cache_dir) / "heads" / slug(target_name) / "answers.jsonl"


def own_answers(target: LoadedModel, count: int, cache_dir: Path, events: TrainEvents) -> list[list[dict[str, str]]]:
    """The target's answers to `count` requests as chats, made where the file lacks them."""
    wanted = requests(count)
    path = answers_path(cache_dir, target.name)
    made = read_answers(path)
    missing = [r for r in wanted if r not in made]
    if missing:
        answer, how, batch = answerer(target)  # loads a model: only when answers are missing
        events.say(f"the target answers {len(missing)} of {count} requests ({how}; kept in {path})")
        make_answers(wanted, path, answer, events.answers, batch)
        made = read_answers(path)
    return [[{"role": "user", "content": r}, {"role": "assistant", "content": made[r]}] for r in wanted]


DEFAULT_ANSWERS = 250  # about 52,000 tokens of chats from the default target; made once and kept
DEFAULT_TOKENS = 180_000  # without answers: the stdlib's text
TOKENS_PER_ANSWER = 256  # the default --tokens with answers: every answer, then a little stdlib text
# Passes over the text. The target's answers are worth more per token than the stdlib's
# (an EAGLE head trained on the answers alone guessed held-out answers about as well as one
# trained on them plus several times as much stdlib text, in half the time): with them,
# less text, more passes.
DEFAULT_EPOCHS = 4.0
EPOCHS_WITH_ANSWERS = 8.0


def default_text(answers: int, own_data: bool) -> tuple[int, float]:
    """The default (--tokens, --epochs) for `answers` of the target's answers, with the
    user's --data or the stdlib's text after them (the user's text is not cut to a little)."""
    if answers > 0 and not own_data:
        return answers * TOKENS_PER_ANSWER, EPOCHS_WITH_ANSWERS
    return DEFAULT_TOKENS, DEFAULT_EPOCHS


def default_answers(target: LoadedModel) -> int:
    """DEFAULT_ANSWERS where answers are quick: the target in a fast dtype (CUDA, bfloat16 or
    float16: transformers answers many requests at once) or llama.cpp able to run it; else 0
    (float32 on a CPU without llama.cpp: they would take longer than the training)."""
    return DEFAULT_ANSWERS if _batches_fast(target) or _llama_cpp_file(target) is not None else 0


def _batches_fast(target: LoadedModel) -> bool:
    """Whether transformers answers batches of requests quickly with this target as loaded:
    on CUDA, and in bfloat16 or float16 (the dtype `auto` picks on CPUs with native bf16)."""
    return target.device.type == "cuda" or target.dtype in (torch.bfloat16, torch.float16)


def _llama_cpp_file(target: LoadedModel) -> Path | None:
    """The target's GGUF file where `--backend auto` would run it through llama.cpp."""
    from speccli.config import LoadConfig
    from speccli.models.loading import choose_backend

    if choose_backend(LoadConfig(), target.resolved, target.device) != "llama.cpp":
        return None
    return target.resolved.gguf_path


ANSWER_BATCH = 16  # requests answered at once through llama.cpp: more tokens/s than one at a time
ANSWER_CONTEXT = 16384  # cache cells for a batch: its prompts and answers together
# Requests answered at once through transformers. On a CPU in bfloat16 a batch yields many
# times the tokens/s of one request at a time, and 32 still gains over 16.
TRANSFORMERS_ANSWER_BATCH = 32


def answerer(target: LoadedModel) -> tuple[Answer, str, int]:
    """Greedy answers from the target, how they are made, and how many requests to ask at
    once: through the loaded model, a batch of requests per `generate` call, where it is in a
    fast dtype or no GGUF file llama.cpp can run is at hand; else (float32 on a CPU, where
    llama.cpp's quantized kernels are several times faster) through llama.cpp, a batch of
    sequences per pass."""
    from speccli.api import Speculator
    from speccli.prompts import Prompt, encode_prompt, has_chat_template

    gguf = None if _batches_fast(target) else _llama_cpp_file(target)
    chat = has_chat_template(target.tokenizer)  # a base model without one continues the request
    if gguf is not None:
        from speccli.backends.llamacpp import LlamaCppLM, LlamaCppWeights
        from speccli.models.kernels.llamacpp_check import extra_buffers_verdict

        weights = LlamaCppWeights.load(gguf, extra_buffers=extra_buffers_verdict(gguf).extra_buffers)
        lm = LlamaCppLM(weights, n_ctx=ANSWER_CONTEXT)
        stop = set(target.eos_token_ids)
        encode = Speculator.over(lm, target.tokenizer, list(stop), None, None).encode

        def answer_batch(asked: Sequence[str]) -> list[str]:
            prompts = [encode(Prompt.of(r, chat=chat)) for r in asked]
            answers: list[list[int]] = []
            for part in _fitting(prompts, ANSWER_TOKENS, ANSWER_CONTEXT):
                answers += lm.greedy_batch(part, ANSWER_TOKENS, stop)
            return [target.tokenizer.decode(ids) for ids in answers]

        return answer_batch, "through llama.cpp", ANSWER_BATCH

    eos = list(target.eos_token_ids)

    def answer_batch_here(asked: Sequence[str]) -> list[str]:
        prompts = [encode_prompt(target.tokenizer, Prompt.of(r, chat=chat)) for r in asked]
        answers = greedy_batch(target.model, prompts, ANSWER_TOKENS, eos)
        return [target.tokenizer.decode(ids, skip_special_tokens=True) for ids in answers]

    return answer_batch_here, "through transformers", TRANSFORMERS_ANSWER_BATCH


@torch.inference_mode()
def greedy_batch(
    model: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int, stop: Sequence[int]
) -> list[list[int]]:
    """Greedy continuations of several prompts in one transformers `generate` call (padded on
    the left, masked), each ending before a `stop` token or at `max_new_tokens`. Rows of a
    batched pass may round differently from a lone one's, so near-ties can go the other way."""
    from transformers import GenerationConfig

    if not stop:
        raise ValueError("greedy_batch needs at least one stop token (also its padding)")
    pad = stop[0]
    width = max(len(p) for p in prompts)
    device = next(model.parameters()).device
    ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=list(stop), pad_token_id=pad)
    rows = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, width:].tolist()
    ends = set(stop)
    return [row[: next((i for i, token in enumerate(row) if token in ends), len(row))] for row in rows]


def _fitting(prompts: list[list[int]], new_tokens: int, cells: int) -> list[list[list[int]]]:
    """`prompts` in order, cut into runs whose prompts and answers fit `cells` cache cells."""
    runs: list[list[list[int]]] = [[]]
    used = 0
    for prompt in prompts:
        size = len(prompt) + new_tokens
        if runs[-1] and used + size > cells:
            runs.append([])
            used = 0
        runs[-1].append(prompt)
        used += size
    return runs


def accuracy_line(kind: str, accuracy: Sequence[float]) -> str:
    if not accuracy:
        return "held-out top-1: no held-out text"
    if kind == "eagle":
        deeper = "".join(f", token {d + 1} {100 * a:.1f}%" for d, a in enumerate(accuracy[1:], start=1))
        return f"held-out top-1: first token {100 * accuracy[0]:.1f}%" + (
            f"{deeper} (where the ones before were right)" if deeper else ""
        )
    return "held-out top-1: " + ", ".join(f"head {i + 1} {100 * a:.1f}%" for i, a in enumerate(accuracy))


# EAGLE's drafting steps unrolled in training. Unrolling lifts held-out accuracy past the
# first token (with 3 steps, depths 2 and 3 well above 1 step's; the first about the same)
# and tree drafts' tokens per step, while training time grows about linearly with the
# steps. Held-out accuracy with 3: BENCHMARKS.md, section "2-core AMD EPYC, AVX512-BF16, no
# AMX" (Medusa and EAGLE heads).
EAGLE_UNROLL = 3


def default_config(kind: str, **overrides: Any) -> TrainConfig:
    # Lower rates, 1e-3 (medusa) and 3e-4 (eagle), learned too slowly in 2-8 epochs on the default target and corpus.
    rate = 3e-3 if kind == "medusa" else 1e-3
    unroll = EAGLE_UNROLL if kind == "eagle" else 1
    values = {
        "kind": kind,
        "learning_rate": rate,
        "eagle_steps": unroll,
        **{k: v for k, v in overrides.items() if v is not None},
    }
    return TrainConfig(**values)
