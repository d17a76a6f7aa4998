"""The GPU check's EAGLE-3 stage (scripts/gpu_check.py): a target of Llama-3.1-8B's shape and an
EAGLE-3 head of its published head's shape (random weights: pass costs do not depend on the
values), timed as specgen drafts and verifies with them:

- a head's draft step (its layer over one token, its norm and output layer, the draw) against
  a one-token target pass: the issue asks at most 10%;
- a target pass over 8 and 16 tokens (what a tree of that many drafted tokens feeds, verified
  in one pass) against a one-token pass: at most 1.15x;
- the target passes with the three features EAGLE-3 reads kept (hooks inside the CUDA graph).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from speccli.autok.costs import measure_costs
from speccli.backends.static import StaticCausalLM
from speccli.config import SamplingConfig
from speccli.drafters.draft_vocab import DraftVocab
from speccli.drafters.eagle3_layer import Eagle3Head
from speccli.drafters.heads import EagleDrafter
from speccli.models.pairs.published_heads import default_feature_layers

# Llama-3.1-8B-Instruct, and yuhuili/EAGLE3-LLaMA3.1-Instruct-8B's head (one layer, 32,000 draft ids).
LLAMA31_8B = dict(
    hidden_size=4096,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    intermediate_size=14336,
    vocab_size=128256,
    tie_word_embeddings=False,
)
DRAFT_VOCAB = 32000
SIZES = (1, 8, 16)


def head_config(shape: dict, draft_vocab: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"],
        num_attention_heads=shape["num_attention_heads"],
        num_key_value_heads=shape["num_key_value_heads"],
        vocab_size=shape["vocab_size"],
        draft_vocab_size=draft_vocab,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=8192,
    )


def timed(device: torch.device, work, repeats: int) -> float:
    """Median seconds of `work()` over `repeats` runs, synchronized."""
    seconds = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        began = time.perf_counter()
        work()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - began)
    return statistics.median(seconds)


def eagle3_costs(
    target, shape: dict, device: torch.device, context: int, draft_vocab: int = DRAFT_VOCAB, repeats: int = 10
) -> dict[str, Any]:
    """Pass and draft-step costs of `target` (a random model of `shape`, bfloat16) with an
    EAGLE-3 head of the matching shape."""
    layers = default_feature_layers(shape["num_hidden_layers"])
    lm = StaticCausalLM(target, capacity=context + 64)
    lm.capture_hidden(layers)
    curve = measure_costs(lm, None, max(SIZES), repeats=3, context_tokens=context, sizes=SIZES)
    verify_ms = {n: 1e3 * s for n, s in sorted(curve.verify_seconds.items())}

    torch.manual_seed(0)
    head = Eagle3Head(head_config(shape, draft_vocab)).to(device, torch.bfloat16)
    vocab = DraftVocab(torch.arange(draft_vocab), shape["vocab_size"])
    drafter = EagleDrafter(
        head,
        vocab,
        target.get_input_embeddings(),
        torch.nn.Sequential(head.norm, head.lm_head),
        dtype=torch.bfloat16,
        feature_layers=layers,
    )
    ids = torch.randint(0, shape["vocab_size"], (context,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        lm.forward(ids[:-1], all_logits=False)
    width = int(lm.last_hidden.shape[-1])
    drafter.start(ids)
    drafter.observe_features(0, lm.last_hidden)
    greedy = SamplingConfig()
    drafter.propose(ids, 1, greedy, None)  # the real entries fed once (a prefill, not a step)
    steps_ms = {}
    # Picked on the device with one copy per draft (the CUDA default), then pass by pass with
    # the host reading each token.
    for name, chains in (("device", drafter.device_chains), ("host", False)):
        drafter.device_chains = chains
        one = timed(device, lambda: drafter.propose(ids, 1, greedy, None), repeats)
        five = timed(device, lambda: drafter.propose(ids, 5, greedy, None), repeats)
        steps_ms[name] = (1e3 * one, 1e3 * (five - one) / 4)  # a step: the layer over one token, its logits, the pick
    first_ms, step_ms = steps_ms["device"]
    lm.rollback(0)
    return {
        "target_shape": "Llama-3.1-8B" if shape == LLAMA31_8B else "smoke",
        "feature_layers": list(layers),
        "features_width": width,
        "verify_ms": {n: round(v, 3) for n, v in verify_ms.items()},
        "verify_ratio": {n: round(v / verify_ms[1], 3) for n, v in verify_ms.items()},
        "head_first_token_ms": round(first_ms, 3),
        "head_step_ms": round(step_ms, 3),
        "head_step_ms_host_picks": round(steps_ms["host"][1], 3),
        "head_step_share_of_pass": round(step_ms / verify_ms[1], 3),
        "graphs_error": lm.graphs_error,
    }


def markdown(row: dict) -> list[str]:
    if not row:
        return []
    if "error" in row:
        return [f"- EAGLE-3 stage: {row['error'].splitlines()[0]}", ""]
    sizes = list(row["verify_ms"])
    return [
        f"## EAGLE-3 head on a {row['target_shape']} target (random weights, bf16, features of layers "
        f"{row['feature_layers']} kept)",
        "",
        "| fed tokens | " + " | ".join(str(s) for s in sizes) + " |",
        "|---" * (len(sizes) + 1) + "|",
        "| target pass, ms | " + " | ".join(f"{row['verify_ms'][s]:.2f}" for s in sizes) + " |",
        "| x 1 token (asked: <= 1.15 at 8-16) | " + " | ".join(f"{row['verify_ratio'][s]:.2f}" for s in sizes) + " |",
        "",
        f"head draft step {row['head_step_ms']} ms = {100 * row['head_step_share_of_pass']:.1f}% of a one-token pass "
        f"(asked: <= 10%); its first token {row['head_first_token_ms']} ms; a step with the host reading each "
        f"token {row['head_step_ms_host_picks']} ms"
        + (f"; graphs: {row['graphs_error']}" if row["graphs_error"] else ""),
        "",
    ]
