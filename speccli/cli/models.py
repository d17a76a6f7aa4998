"""The commands about models: plan (memory before loading), models (aliases, converted weights,
drafts), train (heads for a target) and heads (those trained here)."""

from __future__ import annotations

import math
import sys
from typing import Optional

import typer

from speccli.cli.app import (
    DeviceOpt,
    DraftOpt,
    DtypeOpt,
    ModelOptions,
    QuietOpt,
    TargetOpt,
    TrustRemoteCodeOpt,
    app,
    check_model_names,
    default_draft,
    default_target,
    run_guarded,
)
from speccli.errors import UsageError
from speccli.ui.progress import stderr_progress


@app.command()
def plan(
    target: TargetOpt = None,
    draft: DraftOpt = None,
    quant: str = typer.Option(
        "4bit",
        "--quant",
        help=(
            "The target's format on the GPU: none, 8bit, 4bit (NF4, what --quant auto loads on CUDA), int4, fp8. "
            "GGUF files are dequantized: none."
        ),
    ),
    draft_quant: Optional[str] = typer.Option(None, "--draft-quant", help="The draft's format (default: --quant)."),
    dtype: str = typer.Option("bfloat16", "--dtype", help="The compute dtype: bfloat16 or float16 (2 bytes), float32."),
    tp: int = typer.Option(
        1, "--tp", min=1, help="GPUs the target is split over by tensor parallelism; the draft runs on the first."
    ),
    max_context: int = typer.Option(
        4096, "--max-context", min=1, help="Tokens of KV cache to plan for (the static cache starts at 4,096)."
    ),
    gpu_memory: Optional[float] = typer.Option(
        None,
        "--gpu-memory",
        metavar="GB",
        help="Plan for GPUs of this many GB each (default: the free memory of the visible GPUs).",
    ),
    trust_remote_code: TrustRemoteCodeOpt = False,
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    quiet: QuietOpt = False,
) -> None:
    """What a target and draft need on GPUs, and whether they fit.

    From the models' configs alone (no weights are read or downloaded): weights, KV cache and
    working memory per GPU, against the visible GPUs' free memory or --gpu-memory, and what
    would fit when they do not. Exit code 2 when they do not."""

    def body() -> int:
        from speccli.models.loading import DTYPES, check_heads_split, load_config
        from speccli.models.memory.plan import QUANT_NAMES, meta_model, plan_pair
        from speccli.ui import plan_table

        progress = stderr_progress(quiet)
        if gpu_memory is not None and not (math.isfinite(gpu_memory) and gpu_memory > 0):
            raise UsageError(f"--gpu-memory must be a positive number of GB, got {gpu_memory}", "e.g. --gpu-memory 80")
        for name, value in (("--quant", quant), ("--draft-quant", draft_quant or quant)):
            if value not in QUANT_NAMES:
                raise UsageError(f"{name} takes {', '.join(QUANT_NAMES)}, not {value!r}")
        if dtype not in ("bfloat16", "float16", "float32"):
            raise UsageError(f"--dtype takes bfloat16, float16 or float32, not {dtype!r}")
        check_model_names(target, draft)
        target_name, draft_name = target or default_target(), draft or default_draft()
        if draft_name.strip().lower() == "auto":
            from speccli.models.pairs.drafts import choose_draft

            choice = choose_draft(target_name)
            progress(f"draft: {choice.name} (--draft auto: {choice.reason})")
            draft_name = choice.name
        target_resolved, target_config = load_config(
            target_name, trust_remote_code=trust_remote_code, progress=progress, shapes_only=True
        )
        if tp > 1:
            from speccli.backends.distributed import TP_QUANTS

            if target_resolved.is_gguf:
                raise UsageError(
                    f"--tp splits safetensors models; {target_name} is a GGUF file",
                    "plan the model's safetensors release, or drop --tp",
                )
            if quant not in TP_QUANTS:
                raise UsageError(
                    f"--tp {tp} splits unquantized weights; `generate --tp` refuses --quant {quant}",
                    "plan with --quant none, or drop --tp",
                )
            check_heads_split(target_name, target_config, tp)
        draft_model = None
        if draft_name.strip().lower() not in PLANLESS_DRAFTS:
            draft_resolved, draft_config = load_config(
                draft_name, trust_remote_code=trust_remote_code, progress=progress, shapes_only=True
            )
            draft_model = meta_model(draft_config)
        else:
            draft_resolved = None
        target_quant = "none" if target_resolved.is_gguf else quant
        chosen_draft_quant = "none" if draft_resolved is not None and draft_resolved.is_gguf else (draft_quant or quant)
        gpus, gpu_bytes = _gpu_memory(gpu_memory)
        result = plan_pair(
            target_name,
            meta_model(target_config),
            draft_name if draft_model is not None else None,
            draft_model,
            target_quant,
            chosen_draft_quant,
            DTYPES[dtype],
            tp,
            max_context,
            gpu_bytes,
            gpus,
        )
        (plan_table.print_json if as_json else plan_table.print_table)(result)
        return 2 if result.fits is False else 0

    run_guarded(body)


# Drafters without a model of their own: nothing to plan for.
PLANLESS_DRAFTS = ("none", "ngram", "lookahead", "medusa", "eagle")


def _gpu_memory(gigabytes: float | None) -> tuple[int, float | None]:
    """(GPUs, bytes each): --gpu-memory for GPUs of that size (as many as visible; with none
    visible, as many as --tp asks: 0), else the least free memory among the visible GPUs;
    (0, None) without either."""
    import torch

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gigabytes is not None:
        return visible, gigabytes * 1e9
    if not visible:
        return 0, None
    return visible, float(min(torch.cuda.mem_get_info(i)[0] for i in range(visible)))


@app.command()
def models(
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    show_converted: bool = typer.Option(
        False,
        "--converted",
        help=(
            "List only the converted weights kept in specgen's cache (GGUF files dequantized once, read by later "
            "starts)."
        ),
    ),
    remove_converted: Optional[str] = typer.Option(
        None,
        "--remove-converted",
        metavar="NAME|all",
        help=(
            "Remove the converted weights of GGUF files whose name contains NAME, or all of them; the next start "
            "converts again."
        ),
    ),
    drafts_for: Optional[str] = typer.Option(
        None,
        "--drafts-for",
        metavar="TARGET",
        help=(
            "List the drafts that can serve TARGET (published heads registered for it, registered models sharing "
            "its tokenizer, heads trained here, the drafters without a model), marking the ones --draft auto takes "
            "on the CPU and on CUDA."
        ),
    ),
) -> None:
    """List the model aliases, what each resolves to, and whether each is available offline,
    then the converted weights kept in specgen's cache.

    Available means: an installed offline package, or the local Hugging Face cache.
    """

    def body() -> int:
        from speccli.models.formats import converted
        from speccli.models.names.offline import default_cache_dir
        from speccli.models.names.registry import format_size, list_models
        from speccli.ui import models_table

        cache = default_cache_dir()
        for option, value, hint in (
            ("--remove-converted", remove_converted, "give part of a GGUF file's name, or `all` to remove every entry"),
            ("--drafts-for", drafts_for, "give a target: an alias, a Hub id, a folder or a .gguf file"),
        ):
            if value is not None and not value.strip():
                raise UsageError(f"{option} is empty", hint)
        progress = stderr_progress(False)
        if drafts_for is not None:
            from speccli.calibration import measured_draft_gains
            from speccli.models.pairs.drafts import choose_draft, drafts_for as list_drafts, other_tokenizer_drafts
            from speccli.models.pairs.drafts import registered
            from speccli.models.pairs.shares import vocabulary_shares

            alias = registered(drafts_for)
            others = [a.name for a in other_tokenizer_drafts(alias)] if alias is not None else []
            measured = measured_draft_gains(drafts_for, cache)
            options = list_drafts(drafts_for, cache, measured, vocabulary_shares(drafts_for, others, cache))
            if as_json:
                models_table.print_drafts_json(options)
            else:
                models_table.print_drafts_table(
                    drafts_for,
                    options,
                    choose_draft(drafts_for, measured=measured).reason,
                    choose_draft(drafts_for, cuda=True, measured=measured).reason,
                )
            return 0
        if remove_converted is not None:
            removed = converted.remove(cache, None if remove_converted == "all" else remove_converted)
            for entry in removed:
                progress(f"removed {entry.source} ({entry.dtype}, {format_size(entry.size_bytes)}): {entry.folder}")
            if not removed:
                progress(f"no converted weights match {remove_converted!r} in {cache / converted.FOLDER}")
            return 0
        kept = converted.entries(cache)
        if show_converted:
            if as_json:
                models_table.print_converted_json(kept)
            else:
                models_table.print_converted_table(kept, cache / converted.FOLDER)
            return 0
        from dataclasses import replace

        from speccli.models.memory.plan import weight_sizes

        listings = [replace(item, weights=weight_sizes(item.alias, cache)) for item in list_models()]
        if as_json:
            models_table.print_json(listings)
        else:
            models_table.print_table(listings)
            models_table.print_converted_table(kept, cache / converted.FOLDER)
        return 0

    run_guarded(body)


HEAD_KINDS = ("medusa", "eagle")


@app.command()
def train(
    kind: str = typer.Argument(
        ...,
        help=(
            "medusa (K heads on the target's last hidden state) or eagle (one decoder layer drafting in feature space)."
        ),
    ),
    target: TargetOpt = None,
    data: list[str] = typer.Option(
        [],
        "--data",
        help=(
            "Training text: files or folders of text or code, or .jsonl (messages, prompt/response, "
            "instruction/output or text). Repeatable. Default: the Python standard library's sources and chat turns "
            "made from them (no network)."
        ),
    ),
    tokens: Optional[int] = typer.Option(
        None,
        "--tokens",
        help=(
            "Tokens of text to train on (5% held out for accuracy), the target's answers first. The target's pass "
            "over them takes about 9 minutes per 64,000 tokens on 2 cores in bfloat16 (5 on a CPU with AMX); it is "
            "cached, so a rerun or the other kind skips it. Default: 256 per answer (every answer, then a little "
            "stdlib text), or 180,000 without answers or with --data."
        ),
    ),
    out: Optional[str] = typer.Option(
        None,
        "--out",
        help=(
            "Where to save the heads (a folder or a .safetensors file). Default: the cache, where --draft "
            "medusa|eagle finds them."
        ),
    ),
    answers: Optional[int] = typer.Option(
        None,
        "--answers",
        help=(
            "Requests (made offline: code, explanations, chat, arithmetic, translation) the target answers first, "
            "greedily, to train on its own answers, which is the text the heads draft in; they come first in the "
            "--tokens. Kept in the cache and resumed if cut short. Default: 250 where they are quick: the target in "
            "bfloat16 or float16 (transformers answers 32 at a time; about 17 minutes on 2 cores), on CUDA, or a "
            "GGUF file llama.cpp can run; else 0 (float32 on a CPU without llama.cpp)."
        ),
    ),
    epochs: Optional[float] = typer.Option(
        None,
        "--epochs",
        help="Passes over the training text. Default: 8 with the target's answers and the default text, else 4.",
    ),
    heads: int = typer.Option(
        4, "--heads", help="Medusa: number of heads (head i guesses the token i+1 past the next)."
    ),
    unroll: Optional[int] = typer.Option(
        None,
        "--unroll",
        help=(
            "EAGLE: drafting steps unrolled in training (EAGLE-3's training-time test): step s learns from the "
            "features the head itself predicted, as it drafts at depth s, so tokens past the first are guessed "
            "better. Each step costs one more pass of the head over the text: 3 steps train in about 3 times as "
            "long as 1 (figures: BENCHMARKS.md). Default: 3."
        ),
    ),
    vocab: int = typer.Option(
        8192,
        "--vocab",
        help=(
            "Draft vocabulary: the heads propose only the most frequent ids of the text (the output layer is most "
            "of a head's cost)."
        ),
    ),
    batch: int = typer.Option(8, "--batch", help="Segments of 256 tokens per optimizer step."),
    learning_rate: Optional[float] = typer.Option(
        None, "--lr", help="Learning rate (default: 3e-3 for medusa, 1e-3 for eagle)."
    ),
    seed: int = typer.Option(0, "--seed", help="Seed for initialisation and data order."),
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    trust_remote_code: TrustRemoteCodeOpt = False,
    as_json: bool = typer.Option(False, "--json", help="Print the training record as JSON on stdout."),
    quiet: QuietOpt = False,
) -> None:
    """Train Medusa heads or an EAGLE head for a target, on this machine.

    The frozen target reads the text once (its features are cached, so a rerun or the other
    kind skips this); the heads learn to predict what the target itself would say. Ctrl-C
    saves a checkpoint: the same command resumes. Prints held-out top-1 accuracy and where
    the heads were saved.
    """
    # Heads learn from the target's hidden states: transformers' backends hand them out.
    options = ModelOptions(
        target or default_target(),
        "none",
        device,
        dtype,
        "none",
        None,
        None,
        None,
        trust_remote_code,
        backend="transformers",
    )

    def body() -> int:
        import json
        from pathlib import Path

        progress = stderr_progress(quiet)
        from speccli.heads.command import (
            TrainEvents,
            TrainRequest,
            accuracy_line,
            autocast_bf16,
            default_answers,
            default_config,
            default_text,
            train_heads,
        )
        from speccli.models.names import offline
        from speccli.models.loading import load_model
        from speccli.ui.progress import TrainProgressDisplay

        check_model_names(target, None)
        name = kind.strip().lower()
        if name not in HEAD_KINDS:
            raise UsageError(f"unknown kind of heads {kind!r}", f"use one of: {', '.join(HEAD_KINDS)}")
        for number, value in (
            ("--tokens", tokens),
            ("--heads", heads),
            ("--vocab", vocab),
            ("--batch", batch),
            ("--unroll", unroll),
        ):
            if value is not None and value < 1:
                raise UsageError(f"{number} must be at least 1, got {value}")
        for option, rate in (("--epochs", epochs), ("--lr", learning_rate)):
            if rate is not None and not (math.isfinite(rate) and rate > 0):
                raise UsageError(f"{option} must be a positive number, got {rate}")
        if answers is not None and answers < 0:
            raise UsageError(f"--answers must be 0 or more, got {answers}")
        from speccli.heads.corpus import data_files

        data_files([Path(d) for d in data])  # a missing path is said now, not after the target's answers
        target_config, _ = options.configs()
        loaded = load_model(options.target, target_config, progress)
        asked = default_answers(loaded) if answers is None else answers
        text_tokens, passes = default_text(asked, own_data=bool(data))
        config = default_config(
            name,
            heads=heads,
            vocab=vocab,
            epochs=epochs or passes,
            batch_segments=batch,
            learning_rate=learning_rate,
            seed=seed,
            bf16=autocast_bf16(loaded),
            eagle_steps=unroll,
        )
        request = TrainRequest(
            config,
            tokens or text_tokens,
            tuple(Path(d) for d in data),
            Path(out) if out else None,
            answers=asked,
        )
        display = TrainProgressDisplay(progress, bar=not quiet and sys.stderr.isatty())
        with display:
            outcome = train_heads(
                loaded,
                request,
                offline.default_cache_dir(),
                TrainEvents(display.say, display.features, display.steps, display.answers),
            )
        record = outcome.training
        if as_json:
            print(json.dumps({"kind": name, "path": str(outcome.path), "target": loaded.name, **record}, indent=2))
        progress(
            accuracy_line(name, record["accuracy"])
            + f" (draft vocabulary covers {100 * record['vocab_coverage']:.1f}% of held-out tokens)"
        )
        progress(
            f"saved {outcome.path} in {record['seconds']:.0f} s; use it with --draft {name}"
            + ("" if out is None else f":{outcome.path}")
        )
        return 0

    run_guarded(body)


@app.command(name="heads")
def heads_list(
    as_json: bool = typer.Option(False, "--json", help="Print a JSON list instead of a table."),
) -> None:
    """List the Medusa and EAGLE heads trained on this machine (`specgen train`): the target,
    size, training tokens and held-out accuracy."""

    def body() -> int:
        from speccli.heads.listing import find_heads
        from speccli.models.names import offline
        from speccli.ui import models_table

        found = find_heads(offline.default_cache_dir())
        if as_json:
            models_table.print_heads_json(found)
        else:
            models_table.print_heads_table(found)
        return 0

    run_guarded(body)
