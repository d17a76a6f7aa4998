"""specgen's GPU check: correctness, a profile, pass costs and tokens/s on one GPU, in one call.

    python scripts/gpu_check.py --out gpu-check [--tokenizer gpu-tokenizer] [--budget 420]
    python scripts/gpu_check.py --smoke --out /tmp/smoke        # the same driver, tiny shapes, on the CPU

Random weights of real shapes, made on the device in seconds (scripts/synthetic_pair.py's
shapes: a Qwen2.5-7B-shaped target, an independent 0.5B-shaped draft, and a "self" draft, the
target's first layers, which agrees with it on most greedy tokens). Pass costs do not depend on
the values; acceptance does, so tokens/s with the self draft shows what a well-matched draft
gives and the 0.5B one what drafting costs when nothing is accepted.

Stages, in order, each within its share of --budget seconds (a stage past its time is cut
and says so; the next one runs):

  environment  GPU, versions, the device-to-device copy bandwidth (the memory limit's divisor)
  correctness  float32: greedy tokens of the graphed static backend, chains and trees, equal
               transformers' own `generate` (64 tokens); bfloat16: where they differ, the
               target's top-two logit gap there; sampled: a chi-square test of the first two
               tokens' joint distribution through the speculative loop on a small model
  profile      one-token target passes under torch.profiler: kernels per pass, GPU-busy ms,
               wall ms (host time = wall - busy, when the GPU waits for the host)
  pass_costs   1..32 tokens fed at 256 and 2,048 tokens of context, per weight format (bf16,
               bitsandbytes NF4, torchao int4 and FP8 weight-only where installed), and a draft
               token of each draft
  speed        tokens/s: specgen plain, model draft (self and 0.5B, k 4 and auto) and tree,
               per weight format; transformers' eager `generate` and static cache + torch.compile
               `generate` on the same weights; each specgen method's tokens/s against what its
               own pass costs and acceptance predict (the loop's overhead)

Everything lands in OUT/gpu_check.json and OUT/gpu_check.md after every stage, so a run cut
short still returns what it measured. scripts/gpu_check.sh wraps it for the device machine.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import platform
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from synthetic_pair import SHAPES, make_model, make_self_draft, spread_logits  # noqa: E402

from speccli.autok.costs import CostCurve, measure_costs  # noqa: E402
from speccli.backends.static import StaticCausalLM  # noqa: E402
from speccli.bench.divergence import classify, first_difference  # noqa: E402
from speccli.config import SamplingConfig, SpecConfig  # noqa: E402
from speccli.drafters.model import ModelDrafter  # noqa: E402
from speccli.events import FinishEvent, PrefillEvent, StepEvent, TokenEvent  # noqa: E402
from speccli.loop import SpeculativeDecoder  # noqa: E402
from speccli.backends.fused import fuse_projections  # noqa: E402

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 17, 24, 32)
CONTEXTS = (256, 2048)
# Shares of --budget per stage (the rest is slack for loading and writing).
# The formats share what is left after these.
SHARES = {
    "environment": 0.03,
    "correctness": 0.2,
    "profile": 0.05,
    "peers": 0.2,
    "projection": 0.07,
    "eagle3": 0.08,
    "fusion": 0.04,
}
# The real offline pair's shapes (Qwen2.5-Coder 1.5B target, 0.5B draft) for the projection.
PAIR_TARGET = dict(
    hidden_size=1536,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    intermediate_size=8960,
    vocab_size=151936,
    tie_word_embeddings=True,
)
TRACES = Path(__file__).resolve().parent / "data" / "acceptance-traces-qwen2.5-coder-float32.json"


@dataclass(frozen=True)
class Plan:
    """The shapes and sizes of one run: `real` on a GPU, `smoke` on a CPU in CI."""

    shapes: dict
    sizes: tuple[int, ...]
    contexts: tuple[int, ...]
    new_tokens: int
    prompts: int
    prompt_tokens: int
    formats: tuple[str, ...]
    sample_draws: int


# "+compile": the same weights, the passes through torch.compile (`--compile on`).
# bf16+compile last: a compile cannot be cut short, and the others must not wait for it.
FORMATS = ("bf16", "int4", "int4-hqq", "nf4", "fp8", "bf16+compile")
REAL = Plan(SHAPES["real"], SIZES, CONTEXTS, 64, 3, 200, FORMATS, 3000)
SMOKE_SHAPES = {
    "target": dict(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=512,
        tie_word_embeddings=False,
    ),
    "draft": dict(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
        vocab_size=512,
        tie_word_embeddings=True,
    ),
    "self_layers": 2,
}
SMOKE = Plan(SMOKE_SHAPES, (1, 2, 4, 8), (64, 300), 16, 2, 40, ("bf16",), 400)  # --formats adds bf16+compile


def log(message: str) -> None:
    print(f"gpu_check: {message}", file=sys.stderr, flush=True)


class IdText:
    """A detokenizer for runs without a real tokenizer: ids as numbers (random weights make no text)."""

    def decode(self, token_ids, skip_special_tokens: bool = False) -> str:
        return "".join(f" {i}" for i in token_ids)


@dataclass
class Report:
    """What the run measured so far; written out after every stage."""

    out: Path
    data: dict[str, Any] = field(default_factory=dict)

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "gpu_check.json").write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        (self.out / "gpu_check.md").write_text(markdown(self.data))


class OutOfTime(Exception):
    """A stage used up its share of the budget."""


@dataclass
class Clock:
    deadline: float

    def check(self, what: str) -> None:
        if time.perf_counter() > self.deadline:
            raise OutOfTime(f"out of time before {what}")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------- models


def qwen_config(shape: dict, max_positions: int = 32768):
    from transformers import Qwen2Config

    return Qwen2Config(
        **shape,
        max_position_embeddings=max_positions,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        bos_token_id=0,
        eos_token_id=[1],
        use_sliding_window=False,
    )


def random_model(shape: dict, device: torch.device, dtype: torch.dtype, seed: int, max_positions: int = 32768):
    """A random Qwen2 model that never ends: every run here decodes its full length, and
    `generate` must not suppress an end-of-sequence id the loop would keep."""
    model = make_model(qwen_config(shape, max_positions), device, dtype, seed)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def build_target(plan: Plan, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """The target and its self draft (sharing the first layers' weights, copied)."""
    target = random_model(plan.shapes["target"], device, dtype, seed)
    spread_logits(target, 8.0)
    self_draft = make_self_draft(target, plan.shapes["self_layers"], 0.05, device, dtype)
    return target, self_draft


def build_draft(plan: Plan, device: torch.device, dtype: torch.dtype):
    draft = random_model(plan.shapes["draft"], device, dtype, seed=1)
    spread_logits(draft, 8.0)
    return draft


def quantize(model: torch.nn.Module, fmt: str) -> torch.nn.Module:
    """The model's linear layers (the output head kept in bf16) in `fmt`, in place: int4 and
    FP8 weight-only as `--quant int4|fp8` loads them (int4-hqq: int4's scales chosen by HQQ),
    NF4 through bitsandbytes as `--quant 4bit` does."""
    head = model.get_output_embeddings()
    if fmt == "bf16":
        return model
    if fmt in ("int4", "int4-hqq", "fp8"):
        from torchao.quantization import quantize_

        from speccli.models.kernels.torchao_quant import torchao_config

        config = torchao_config(fmt.removesuffix("-hqq")).quant_type  # what `--quant int4|fp8` loads
        if fmt == "int4-hqq":
            from dataclasses import replace

            config = replace(config, int4_choose_qparams_algorithm="hqq")
        quantize_(model, config, filter_fn=lambda m, _: isinstance(m, torch.nn.Linear) and m is not head)
        return model
    if fmt == "nf4":
        import bitsandbytes as bnb

        device = next(model.parameters()).device
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear) and child is not head:
                    layer = bnb.nn.Linear4bit(
                        child.in_features,
                        child.out_features,
                        bias=child.bias is not None,
                        compute_dtype=torch.bfloat16,
                        quant_type="nf4",
                        device="meta",
                    )
                    layer.weight = bnb.nn.Params4bit(
                        child.weight.data.to("cpu"), requires_grad=False, quant_type="nf4", compress_statistics=True
                    )
                    if child.bias is not None:
                        layer.bias = torch.nn.Parameter(child.bias.data, requires_grad=False)
                    setattr(parent, name, layer.to(device))
        return model
    raise ValueError(f"unknown weight format {fmt!r}")


# Each format's name in speccli.models.memory.plan, which counts its bytes from the architecture
# (a quantized model's own tensors are packed or subclassed: their numel says little).
PLAN_QUANT = {"bf16": "none", "int4": "int4", "int4-hqq": "int4", "nf4": "4bit", "fp8": "fp8"}


def weight_bytes(model: torch.nn.Module, fmt: str) -> int:
    """Bytes a one-token pass reads in `fmt`: the weights but the input embedding (one row of
    it is read; a tied one is the output layer too, read whole)."""
    from speccli.models.memory.plan import memory_need, meta_model

    shape = meta_model(model.config)
    total = memory_need(shape, PLAN_QUANT[fmt.removesuffix("+compile")], torch.bfloat16).weights
    embedding = shape.get_input_embeddings().weight
    if shape.get_output_embeddings() is None or shape.get_output_embeddings().weight is not embedding:
        total -= embedding.numel() * 2
    return round(total)


# ---------------------------------------------------------------------------- stages


def environment(device: torch.device, smoke: bool) -> dict:
    import transformers

    info: dict[str, Any] = {
        "device": str(device),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "smoke": smoke,
    }
    for package in ("bitsandbytes", "torchao"):
        with contextlib.suppress(Exception):
            info[package] = __import__(package).__version__
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            gpu=props.name, memory_gib=round(props.total_memory / 2**30, 1), capability=f"{props.major}.{props.minor}"
        )
    size = 2**30 if device.type == "cuda" else 2**26
    source = torch.empty(size, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    sync(device)
    times = []
    for _ in range(10):
        started = time.perf_counter()
        target.copy_(source)
        sync(device)
        times.append(time.perf_counter() - started)
    # A copy reads and writes every byte.
    info["copy_bandwidth_gbs"] = round(2 * size / min(times) / 1e9, 1)
    return info


def greedy_tokens(decoder: SpeculativeDecoder, prompt: list[int], spec: SpecConfig) -> list[int]:
    return [e.token_id for e in decoder.generate(prompt, SamplingConfig(), spec) if isinstance(e, TokenEvent)]


def reference_tokens(model, prompt: list[int], new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
    return out[0, len(prompt) :].tolist()


def prompts_for(plan: Plan, vocab: int, seed: int = 7) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (plan.prompt_tokens,), generator=generator).tolist() for _ in range(plan.prompts)]


def correctness(plan: Plan, device: torch.device, text, clock: Clock) -> dict:
    result: dict[str, Any] = {}
    # float32: any difference is a fault.
    target, self_draft = build_target(plan, device, torch.float32)
    prompts = prompts_for(plan, target.config.vocab_size)
    references = [reference_tokens(target, p, plan.new_tokens) for p in prompts]
    checks = []
    # Unfused with graphs and without, then fused as `--quant none` loads a model on CUDA.
    for graphs, fused in (
        ((True, False), (False, False), (True, True)) if device.type == "cuda" else ((False, False), (False, True))
    ):
        if fused:
            fuse_projections(target)
            fuse_projections(self_draft)
        target_lm = StaticCausalLM(target, graphs=graphs)
        drafter = ModelDrafter(StaticCausalLM(self_draft, graphs=graphs), target.config.vocab_size)
        decoder = SpeculativeDecoder(target_lm, text, [], drafter)
        for tree in (False, True):
            clock.check("the float32 checks")
            spec = SpecConfig(k=4, max_new_tokens=plan.new_tokens, tree=tree)
            equal = [greedy_tokens(decoder, p, spec) == r for p, r in zip(prompts, references)]
            checks.append(
                {
                    "dtype": "float32",
                    "graphs": target_lm.graphs_enabled,
                    "fused": fused,
                    "tree": tree,
                    "equal": sum(equal),
                    "prompts": len(equal),
                    "graphs_error": target_lm.graphs_error,
                }
            )
    result["float32_greedy"] = checks
    del target, self_draft, decoder, drafter, target_lm
    free(device)
    # bfloat16: passes of different sizes round differently; a divergence must be a near-tie.
    clock.check("the bfloat16 check")
    target, self_draft = build_target(plan, device, torch.bfloat16)
    references = [reference_tokens(target, p, plan.new_tokens) for p in prompts]
    fuse_projections(target)  # as the product loads them
    fuse_projections(self_draft)
    target_lm = StaticCausalLM(target)
    decoder = SpeculativeDecoder(
        target_lm, text, [], ModelDrafter(StaticCausalLM(self_draft), target.config.vocab_size)
    )
    divergences = []
    for prompt, reference in zip(prompts, references):
        spec_tokens = greedy_tokens(decoder, prompt, SpecConfig(k=4, max_new_tokens=plan.new_tokens))
        at = first_difference(reference, spec_tokens)
        if at is None:
            continue
        with torch.inference_mode():
            ids = torch.tensor([prompt + reference[:at]], device=device)
            logits = target(input_ids=ids).logits[0, -1].float().cpu()
        divergences.append(classify(at, reference, spec_tokens, logits, torch.bfloat16).as_dict())
    result["bfloat16_divergences"] = {"prompts": len(prompts), "divergences": divergences}
    del target, self_draft, decoder, target_lm
    free(device)
    clock.check("the sampled test")
    result["sampled"] = sampled_test(plan, device, text)
    return result


def sampled_test(plan: Plan, device: torch.device, text) -> dict:
    """The first two tokens after a prompt, drawn `sample_draws` times through the loop with a
    draft of k 3 (rejection rule, no seed): their joint against the target's exact one."""
    from scipy.stats import chisquare

    from speccli import loop as loop_module

    shape = dict(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=8,
        tie_word_embeddings=False,
    )
    target = random_model(shape, device, torch.float32, seed=5, max_positions=64)
    spread_logits(target, 40.0)
    draft = random_model(shape, device, torch.float32, seed=6, max_positions=64)
    spread_logits(draft, 40.0)
    prompt = [3, 4, 5]
    with torch.inference_mode():
        first = torch.softmax(target(input_ids=torch.tensor([prompt], device=device)).logits[0, -1].double(), -1)
        both = torch.tensor([[*prompt, t] for t in range(8)], device=device)
        second = torch.softmax(target(input_ids=both).logits[:, -1].double(), -1)
    expected = (first[:, None] * second).flatten().cpu()
    counts = torch.zeros(64)
    decoder = SpeculativeDecoder(StaticCausalLM(target), text, [], ModelDrafter(StaticCausalLM(draft), 8))
    coupled = loop_module.coupled
    loop_module.coupled = lambda sampling: False  # the rejection rule, not the seeded coupling
    try:
        sampling = SamplingConfig(temperature=1.0)
        for _ in range(plan.sample_draws):
            tokens = [
                e.token_id
                for e in decoder.generate(prompt, sampling, SpecConfig(k=3, max_new_tokens=2))
                if isinstance(e, TokenEvent)
            ]
            counts[tokens[0] * 8 + tokens[1]] += 1
    finally:
        loop_module.coupled = coupled
    wanted = expected * plan.sample_draws
    large = wanted >= 5
    observed = counts[large].tolist() + [float(counts[~large].sum())]
    wanted_list = wanted[large].tolist() + [float(wanted[~large].sum())]
    if wanted_list[-1] == 0:
        observed, wanted_list = observed[:-1], wanted_list[:-1]
    pvalue = float(chisquare(observed, wanted_list).pvalue)
    impossible = int(counts[expected == 0].sum())
    return {
        "draws": plan.sample_draws,
        "pvalue": pvalue,
        "impossible_draws": impossible,
        "passed": pvalue >= 1e-3 and impossible == 0,
    }


def compiled(fmt: str) -> bool:
    return fmt.endswith("+compile")


def profiled(device: torch.device, work: Callable[[], Any], count: int) -> dict:
    """Run `work` under the profiler: per unit of `count`, wall ms, device kernels and the
    ms they kept the GPU busy, the host's share (wall - busy: the GPU waiting for it), and
    the CPU-side operator count."""
    from torch.profiler import ProfilerActivity, profile as profiler

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    started = time.perf_counter()
    with profiler(activities=activities) as prof:
        work()
        sync(device)
    wall_ms = 1e3 * (time.perf_counter() - started) / count
    kernels, busy_us, ops = 0, 0.0, 0
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels += 1
            busy_us += getattr(event, "device_time", None) or getattr(event, "cuda_time", 0.0) or 0.0
        else:
            ops += 1
    result = {
        "wall_ms": round(wall_ms, 3),
        "kernels": kernels / count,
        "cpu_ops": ops / count,
        "gpu_busy_ms": round(busy_us / 1e3 / count, 3),
    }
    if kernels:
        result["host_ms"] = round(wall_ms - result["gpu_busy_ms"], 3)
    return result


def profile(plan: Plan, device: torch.device, clock: Clock, target, fmt: str, steps: int = 20) -> dict:
    """One-token passes of the graphed target, and steps of the decode loop (plain decoding,
    where every step is one such pass), under the profiler."""
    lm = StaticCausalLM(target, compile=compiled(fmt))
    prompt = prompts_for(plan, target.config.vocab_size)[0]
    lm.forward(prompt, all_logits=False)
    for token in range(3):  # capture (and compile) before profiling
        lm.forward([token + 2])

    def passes() -> None:
        for token in range(steps):
            int(torch.argmax(lm.forward([token + 2])[-1]))  # the host waits for each pass, as decoding does

    result = {
        "steps": steps,
        "pass": profiled(device, passes, steps),
        "backend": ("cuda graphs" if lm.graphs_enabled else "eager") + (", compiled" if lm.compile_enabled else ""),
        "graphs_error": lm.graphs_error,
        "compile_error": lm.compile_error,
    }
    lm.rollback(0)
    clock.check("profiling the loop")
    decoder = SpeculativeDecoder(lm, IdText(), [], None)
    spec = SpecConfig(k=0, max_new_tokens=steps)
    list(decoder.generate(prompt, SamplingConfig(), spec))  # the loop's own warm-up

    def loop() -> None:
        list(decoder.generate(prompt, SamplingConfig(), spec))

    # Each generation re-reads its prompt's last token (one pass) and then takes `steps` steps.
    result["loop_step"] = profiled(device, loop, steps)
    return result


def pass_costs(
    plan: Plan, device: torch.device, clock: Clock, target, drafts: dict, fmt: str, bandwidth: float
) -> dict:
    lm = StaticCausalLM(target, capacity=max(plan.contexts) + max(plan.sizes) + 8, compile=compiled(fmt))
    rows: dict[str, Any] = {
        "format": fmt,
        "weight_bytes": weight_bytes(target, fmt),
        "graphs_error": None,
        "contexts": {},
    }
    for context in plan.contexts:
        clock.check(f"{fmt} passes at {context} tokens")
        curve = measure_costs(lm, None, max(plan.sizes), repeats=3, context_tokens=context, sizes=plan.sizes)
        costs = {n: round(1e3 * s, 3) for n, s in sorted(curve.verify_seconds.items())}
        rows["contexts"][context] = {"ms": costs, "ratio_to_one": {n: round(c / costs[1], 3) for n, c in costs.items()}}
    rows.update(
        graphs_error=lm.graphs_error, compile_error=lm.compile_error, setup_seconds=round(lm.setup_seconds, 1)
    )  # graph captures (and compiles), once per process
    if bandwidth:
        limit_ms = rows["weight_bytes"] / (bandwidth * 1e9) * 1e3
        one = rows["contexts"][plan.contexts[0]]["ms"][1]
        rows["memory_limit_ms"] = round(limit_ms, 3)
        rows["share_of_memory_limit"] = round(limit_ms / one, 3)
    rows["draft_token_ms"], rows["draft_chain_ms"] = {}, {}
    for name, draft in drafts.items():
        clock.check(f"the {name} draft's token")
        draft_lm = StaticCausalLM(draft, compile=compiled(fmt))
        curve = measure_costs(draft_lm, None, 1, repeats=5, context_tokens=plan.contexts[0], sizes=(1,))
        rows["draft_token_ms"][name] = round(1e3 * curve.verify_seconds[1], 3)
        if not compiled(fmt):  # (compiling twice more per draft would take the stage's time)
            rows["draft_chain_ms"][name] = chain_costs(draft, device, plan.contexts[0])
    return rows


def chain_costs(draft, device: torch.device, context_tokens: int, k: int = 4, repeats: int = 10) -> dict:
    """ms per drafted token of a greedy draft of k (the median draft): the chain on the device
    (one graph per k on CUDA) and the same drafter pass by pass, each draft after re-reading
    the context's last token."""
    from gpu_heads import timed

    context = [2 + i % 50 for i in range(context_tokens)]
    result = {}
    for name, chains in (("device", None), ("host", False)):
        drafter = ModelDrafter(StaticCausalLM(draft, device_chains=chains), draft.config.vocab_size)
        drafter.propose(context, k, SamplingConfig(), None)  # captures
        seconds = timed(device, lambda: drafter.propose(context, k, SamplingConfig(), None), repeats)
        result[name] = round(1e3 * seconds / k, 3)
        result[f"{name}_chains"] = drafter.model.chains
    return result


def fusion(plan: Plan, device: torch.device, clock: Clock, target) -> dict:
    """One-token and widest pass costs of the bf16 target before and after its q/k/v and
    gate/up are fused (as `--quant none` loads a model on CUDA); the target stays fused."""
    sizes = (1, max(plan.sizes))
    result: dict[str, Any] = {}
    for name in ("unfused", "fused"):
        clock.check(f"{name} passes")
        if name == "fused":
            reserved = torch.cuda.memory_reserved if device.type == "cuda" else (lambda: 0)
            before = reserved()
            result["layers"] = fuse_projections(target)
            result["reserved_gb_added"] = round((reserved() - before) / 1e9, 2)  # the load's cost in memory
        lm = StaticCausalLM(target, capacity=plan.contexts[0] + max(sizes) + 8)
        curve = measure_costs(lm, None, max(sizes), repeats=3, context_tokens=plan.contexts[0], sizes=sizes)
        result[name] = {n: round(1e3 * s, 3) for n, s in sorted(curve.verify_seconds.items())}
        del lm
        free(device)
    result["fused_over_unfused"] = {n: round(result["fused"][n] / result["unfused"][n], 3) for n in result["fused"]}
    return result


def projection(plan: Plan, device: torch.device, clock: Clock, draft, formats: tuple[str, ...]) -> dict:
    """The real pair's greedy acceptance (recorded on the CPU: scripts/acceptance_traces.py)
    replayed against this GPU's pass costs of the same shapes: projected tokens/s, no more."""
    from acceptance_traces import load_traces, project

    traces = load_traces(TRACES)
    shape = PAIR_TARGET if plan is REAL else plan.shapes["target"]
    draft_lm = StaticCausalLM(draft)
    draft_curve = measure_costs(draft_lm, None, 1, repeats=5, context_tokens=plan.contexts[0], sizes=(1,))
    result: dict[str, Any] = {"traces": TRACES.name, "draft_token_ms": round(1e3 * draft_curve.verify_seconds[1], 3)}
    for fmt in formats:
        clock.check(f"the projection in {fmt}")
        target = random_model(shape, device, torch.bfloat16, seed=3)
        try:
            quantize(target, fmt)
        except Exception as error:  # noqa: BLE001 - a format this machine lacks
            result[fmt] = {"error": f"{type(error).__name__}: {error}"}
            continue
        lm = StaticCausalLM(target)
        sizes = tuple(n for n in range(1, 10) if n <= max(plan.sizes))
        curve = measure_costs(lm, None, max(sizes), repeats=3, context_tokens=plan.contexts[0], sizes=sizes)
        verify_ms = {n: 1e3 * seconds for n, seconds in curve.verify_seconds.items()}
        result[fmt] = {
            "verify_ms": {n: round(ms, 3) for n, ms in verify_ms.items()},
            **project(traces, verify_ms, result["draft_token_ms"]),
        }
        del lm, target
        free(device)
    return result


def run_method(decoder: SpeculativeDecoder, prompts: list[list[int]], spec: SpecConfig) -> dict:
    """Tokens/s over the prompts (decoding only: prefill excluded), and the steps' shape."""
    tokens = seconds = 0.0
    steps: list[StepEvent] = []
    for prompt in prompts:
        prefill = 0.0
        for event in decoder.generate(prompt, SamplingConfig(), spec):
            if isinstance(event, PrefillEvent):
                prefill = event.seconds
            elif isinstance(event, StepEvent):
                steps.append(event)
            elif isinstance(event, FinishEvent):
                tokens += event.new_tokens
                seconds += event.seconds - prefill
    accepted = sum(s.accepted for s in steps)
    return {
        "tokens_per_s": round(tokens / seconds, 2),
        "tokens": int(tokens),
        "steps": len(steps),
        "tokens_per_step": round(tokens / max(1, len(steps)), 3),
        "acceptance": round(accepted / max(1, sum(s.drafted for s in steps)), 3),
        "fed": [s.fed or s.drafted + 1 for s in steps],
        "drafted": [s.drafted for s in steps],
    }


def predicted(run: dict, verify_ms: dict[int, float], draft_ms: float | None) -> float | None:
    """Tokens/s the run's own steps would give at the measured pass costs (no loop overhead)."""
    sizes = sorted(verify_ms)
    total = 0.0
    for fed, drafted in zip(run["fed"], run["drafted"]):
        size = next((s for s in sizes if s >= fed), None)
        if size is None:
            return None
        total += verify_ms[size] + (draft_ms or 0.0) * drafted
    return round(run["tokens"] / (total / 1e3), 2) if total else None


def hf_generate_speed(model, prompts: list[list[int]], new_tokens: int, **kwargs) -> dict:
    with torch.inference_mode():
        warm = torch.tensor([prompts[0]], device=model.device)
        model.generate(warm, max_new_tokens=new_tokens, do_sample=False, **kwargs)  # warm-up (and compile)
        seconds = 0.0
        for prompt in prompts:
            ids = torch.tensor([prompt], device=model.device)
            sync(model.device)
            started = time.perf_counter()
            model.generate(ids, max_new_tokens=new_tokens, do_sample=False, **kwargs)
            sync(model.device)
            seconds += time.perf_counter() - started
    # Prefill included here (generate has no hook to leave it out): a prompt's prefill is one pass.
    return {"tokens_per_s": round(len(prompts) * new_tokens / seconds, 2)}


def peers(plan: Plan, device: torch.device, clock: Clock) -> dict:
    """transformers' own decoding of the bf16 target's weights: eager `generate`, and its
    documented fast path (a static cache, which `generate` compiles with torch.compile)."""
    target, _ = build_target(plan, device, torch.bfloat16)
    prompts = prompts_for(plan, target.config.vocab_size, seed=11)
    result: dict[str, Any] = {}
    for name, kwargs in (("hf-eager", {}), ("hf-static-compile", {"cache_implementation": "static"})):
        clock.check(name)
        try:
            result[name] = hf_generate_speed(target, prompts, plan.new_tokens, **kwargs)
        except Exception as error:  # noqa: BLE001 - a peer that fails is reported, not fatal
            result[name] = {"error": f"{type(error).__name__}: {error}"}
    return result


def speed(plan: Plan, device: torch.device, clock: Clock, text, target, drafts: dict, costs: dict, fmt: str) -> dict:
    prompts = prompts_for(plan, target.config.vocab_size, seed=11)
    result: dict[str, Any] = {"format": fmt}
    target_lm = StaticCausalLM(target, compile=compiled(fmt))
    verify_ms = costs.get("contexts", {}).get(plan.contexts[0], {}).get("ms", {})
    methods: list[tuple[str, Any, SpecConfig, float | None]] = [
        ("specgen-plain", None, SpecConfig(k=0, max_new_tokens=plan.new_tokens), None)
    ]
    for name, draft in drafts.items():
        drafter = ModelDrafter(StaticCausalLM(draft, compile=compiled(fmt)), target.config.vocab_size)
        draft_ms = costs.get("draft_token_ms", {}).get(name)
        methods += [
            (f"specgen-draft-{name}-k4", drafter, SpecConfig(k=4, max_new_tokens=plan.new_tokens), draft_ms),
            (f"specgen-draft-{name}-auto", drafter, SpecConfig(k="auto", max_new_tokens=plan.new_tokens), draft_ms),
            (f"specgen-tree-{name}", drafter, SpecConfig(k=4, max_new_tokens=plan.new_tokens, tree=True), draft_ms),
        ]
    for name, drafter, spec, draft_ms in methods:
        clock.check(name)
        decoder = SpeculativeDecoder(target_lm, text, [], drafter)
        if verify_ms:  # what a calibration gives the product: k auto and trees start from it
            decoder.costs = CostCurve(
                {int(n): ms / 1e3 for n, ms in verify_ms.items()}, None if draft_ms is None else draft_ms / 1e3
            )
        run_method(decoder, prompts[:1], spec)  # warm-up: graphs of the sizes this method feeds
        run = run_method(decoder, prompts, spec)
        run["predicted_tokens_per_s"] = predicted(run, {int(k): v for k, v in verify_ms.items()}, draft_ms)
        if run["predicted_tokens_per_s"]:
            run["share_of_predicted"] = round(run["tokens_per_s"] / run["predicted_tokens_per_s"], 3)
        del run["fed"], run["drafted"]
        result[name] = run
    return result


# ---------------------------------------------------------------------------- report


def eagle3(plan: Plan, device: torch.device) -> dict:
    """A published EAGLE-3 head's shape on Llama-3.1-8B's (scripts/gpu_heads.py)."""
    from gpu_heads import LLAMA31_8B, eagle3_costs

    shape = LLAMA31_8B if plan is REAL else plan.shapes["target"]
    target = random_model(shape, device, torch.bfloat16, seed=3, max_positions=8192)
    try:
        return eagle3_costs(target, shape, device, context=plan.contexts[0], draft_vocab=32000 if plan is REAL else 100)
    finally:
        del target
        free(device)


def markdown(data: dict) -> str:
    env = data.get("environment", {})
    lines = [
        f"# specgen GPU check: {env.get('gpu', env.get('device', '?'))}",
        "",
        f"torch {env.get('torch')}, transformers {env.get('transformers')}, bitsandbytes "
        f"{env.get('bitsandbytes', 'absent')}, torchao {env.get('torchao', 'absent')}; copy bandwidth "
        f"{env.get('copy_bandwidth_gbs')} GB/s{' (smoke run: tiny shapes)' if env.get('smoke') else ''}.",
        "",
    ]
    for stage, error in data.get("errors", {}).items():
        lines.append(f"- {stage}: {error.splitlines()[0] if error else ''}")
    correct = data.get("correctness", {})
    for check in correct.get("float32_greedy", []):
        lines.append(
            f"- float32 greedy, {'graphs' if check['graphs'] else 'eager'}{', fused' if check.get('fused') else ''}, "
            f"{'tree' if check['tree'] else 'chain'}: "
            f"{check['equal']}/{check['prompts']} equal to transformers' generate"
        )
    if "bfloat16_divergences" in correct:
        found = correct["bfloat16_divergences"]["divergences"]
        lines.append(
            f"- bfloat16: {len(found)} divergence(s) in {correct['bfloat16_divergences']['prompts']} prompts"
            + "".join(f"; {d['kind']} at {d['position']} (gap {d['gap']})" for d in found)
        )
    if "sampled" in correct:
        s = correct["sampled"]
        lines.append(
            f"- sampled, first two tokens' joint: p = {s['pvalue']:.3g} over {s['draws']} draws "
            f"({'pass' if s['passed'] else 'FAIL'})"
        )
    for fmt, p in data.get("profile", {}).items():
        for unit in ("pass", "loop_step"):
            if p and unit in p:
                u = p[unit]
                lines.append(
                    f"- profile, {fmt} ({p['backend']}), per {unit.replace('_', ' ')}: {u['kernels']:.0f} kernels, "
                    f"GPU busy {u['gpu_busy_ms']} ms, wall {u['wall_ms']} ms"
                    + (f", host {u['host_ms']} ms" if "host_ms" in u else f", {u['cpu_ops']:.0f} CPU ops")
                )
    fused = data.get("fusion", {})
    if "fused" in fused:
        lines.append(
            f"- q/k/v and gate/up fused (bf16, {fused['layers']} layers, "
            f"{fused['reserved_gb_added']} GB more reserved), "
            "pass ms unfused -> fused: "
            + ", ".join(
                f"{n} tokens {fused['unfused'][n]} -> {fused['fused'][n]} ({fused['fused_over_unfused'][n]:.2f}x)"
                for n in fused["fused"]
            )
        )
    lines.append("")
    for fmt, rows in data.get("pass_costs", {}).items():
        if "error" in rows:
            lines.append(f"- {fmt}: {rows['error'].splitlines()[0]}")
            continue
        sizes = list(next(iter(rows["contexts"].values()))["ms"])
        lines += [
            f"## pass costs, {fmt} ({rows['weight_bytes'] / 1e9:.2f} GB read per pass"
            + (
                f"; one-token pass at {100 * rows['share_of_memory_limit']:.0f}% of the memory limit"
                if "share_of_memory_limit" in rows
                else ""
            )
            + ")",
            "",
            "| context | " + " | ".join(str(s) for s in sizes) + " |",
            "|---" * (len(sizes) + 1) + "|",
        ]
        for context, row in rows["contexts"].items():
            lines.append(f"| {context}, ms | " + " | ".join(f"{row['ms'][s]:.2f}" for s in sizes) + " |")
            lines.append(f"| {context}, x 1 | " + " | ".join(f"{row['ratio_to_one'][s]:.2f}" for s in sizes) + " |")
        lines += [
            "",
            "draft token: "
            + ", ".join(f"{k} {v} ms" for k, v in rows["draft_token_ms"].items())
            + (
                "; drafting 4 (per token, chain on the device / pass by pass): "
                + ", ".join(f"{k} {v['device']} / {v['host']} ms" for k, v in rows["draft_chain_ms"].items())
                if rows.get("draft_chain_ms")
                else ""
            )
            + f"; captures and compiles: {rows['setup_seconds']} s"
            + "".join(
                f"; {key}: {rows[key].splitlines()[0]}" for key in ("graphs_error", "compile_error") if rows[key]
            ),
            "",
        ]
    peer_runs = data.get("peers", {})
    for name, run in peer_runs.items():
        lines.append(
            f"- {name} (bf16): " + (run["error"].splitlines()[0] if "error" in run else f"{run['tokens_per_s']} tok/s")
        )
    plain = data.get("speed", {}).get("bf16", {}).get("specgen-plain", {}).get("tokens_per_s")
    compiled = peer_runs.get("hf-static-compile", {}).get("tokens_per_s")
    if plain and compiled:
        lines.append(f"- specgen-plain / hf-static-compile, bf16: {plain / compiled:.2f}x")
    lines.append("")
    for fmt, runs in data.get("speed", {}).items():
        if "error" in runs:
            lines.append(f"- speed {fmt}: {runs['error'].splitlines()[0]}")
            continue
        lines += [
            f"## tokens/s, {fmt}",
            "",
            "| method | tok/s | tokens/step | acceptance | of predicted |",
            "|---|---|---|---|---|",
        ]
        for name, run in runs.items():
            if not isinstance(run, dict):
                continue
            if "error" in run:
                lines.append(f"| {name} | {run['error'][:60]} | | | |")
                continue
            share = run.get("share_of_predicted")
            lines.append(
                f"| {name} | {run['tokens_per_s']} | {run.get('tokens_per_step', '')} | "
                f"{run.get('acceptance', '')} | {'' if share is None else f'{100 * share:.0f}%'} |"
            )
        lines.append("")
    proj = data.get("projection", {})
    if proj:
        lines += [
            "## projection: the real pair on this GPU",
            "",
            f"Qwen2.5-Coder 1.5B/0.5B shapes (random weights) timed here; the real pair's greedy acceptance "
            f"replayed from {proj.get('traces')} (CPU, float32). A projection, not a measurement.",
            "",
            "| target format | plain tok/s | best k | tok/s | x plain | k 4 x plain |",
            "|---|---|---|---|---|---|",
        ]
        for fmt, row in proj.items():
            if isinstance(row, dict) and "error" in row:
                lines.append(f"| {fmt} | {row['error'][:60]} | | | | |")
            elif isinstance(row, dict):
                best = row["k"][row["best_k"]]
                lines.append(
                    f"| {fmt} | {row['plain_tokens_per_s']} | {row['best_k']} | {best['tokens_per_s']} | "
                    f"{best['speedup']:.2f} | {row['k'][4]['speedup']:.2f} |"
                )
        lines.append("")
    from gpu_heads import markdown as eagle3_lines

    lines += eagle3_lines(data.get("eagle3", {}))
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- main


def staged(report: Report, name: str, seconds: float, work: Callable[[Clock], Any]) -> Any:
    """Run one stage within `seconds`; its result or its error lands in the report."""
    log(f"{name} (up to {seconds:.0f} s)")
    began = time.perf_counter()
    try:
        value = work(Clock(began + seconds))
    except Exception as error:  # noqa: BLE001 - one stage's failure must not lose the others
        log(f"{name}: {type(error).__name__}: {error}")
        report.data.setdefault("errors", {})[name] = (
            str(error) if isinstance(error, OutOfTime) else f"{type(error).__name__}: {error}\n{traceback.format_exc()}"
        )
        value = None
    report.data.setdefault("stage_seconds", {})[name] = round(time.perf_counter() - began, 1)
    report.save()
    return value


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("gpu-check"))
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (CI): the same stages in seconds")
    parser.add_argument("--device", default=None, help="default: cuda, or cpu with --smoke")
    parser.add_argument("--budget", type=float, default=None, help="seconds for the whole run (default 420; smoke 100)")
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="a tokenizer folder to detokenize with, as users' runs do (default: ids as numbers)",
    )
    parser.add_argument(
        "--formats",
        default=None,
        help=f"weight formats to time, comma-separated, bf16 first (default {','.join(FORMATS)}; smoke bf16)",
    )
    args = parser.parse_args()
    plan = SMOKE if args.smoke else REAL
    device = torch.device(args.device or ("cpu" if args.smoke else "cuda"))
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here: run on a GPU, or add --smoke for the CPU run")
    budget = args.budget or (100.0 if args.smoke else 420.0)
    formats = tuple(args.formats.split(",")) if args.formats else plan.formats
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown:
        parser.error(f"--formats takes {', '.join(FORMATS)}; not {', '.join(unknown)}")
    text = IdText()
    if args.tokenizer:
        from transformers import AutoTokenizer

        text = AutoTokenizer.from_pretrained(args.tokenizer)
    report = Report(args.out)
    started = time.perf_counter()

    def share(stage: str) -> float:
        return max(5.0, budget * SHARES[stage])

    env = staged(report, "environment", share("environment"), lambda clock: environment(device, args.smoke)) or {}
    report.data["environment"] = env
    report.data["correctness"] = (
        staged(report, "correctness", share("correctness"), lambda clock: correctness(plan, device, text, clock)) or {}
    )
    report.data["pass_costs"], report.data["speed"], report.data["profile"] = {}, {}, {}
    drafts = {"self": None, "0.5b": build_draft(plan, device, torch.bfloat16)}
    fuse_projections(drafts["0.5b"])  # a bf16 draft, loaded fused on CUDA

    def run_peers() -> None:
        report.data["peers"] = staged(report, "peers", share("peers"), lambda clock: peers(plan, device, clock)) or {}
        free(device)

    bandwidth = env.get("copy_bandwidth_gbs", 0.0) if device.type == "cuda" else 0.0
    if TRACES.is_file():
        report.data["projection"] = (
            staged(
                report,
                "projection",
                share("projection"),
                lambda clock: projection(plan, device, clock, drafts["0.5b"], ("bf16", "int4", "nf4")),
            )
            or {}
        )
    for index, fmt in enumerate(formats):
        left = budget - (time.perf_counter() - started)
        if left < 10:
            report.data["pass_costs"][fmt] = {"error": "out of time before this format"}
            continue
        per_format = (left - (share("peers") if "peers" not in report.data else 0.0)) / (len(formats) - index)
        if compiled(fmt) and "peers" not in report.data:
            run_peers()  # before the compiled format: a compile cannot be cut short
        target, drafts["self"] = build_target(plan, device, torch.bfloat16)
        try:
            quantize(target, fmt.removesuffix("+compile"))
        except Exception as error:  # noqa: BLE001 - a format this machine lacks is reported, not fatal
            report.data["pass_costs"][fmt] = {"error": f"{type(error).__name__}: {error}"}
            report.save()
            target = None
            drafts["self"] = None
            free(device)
            continue
        if fmt.removesuffix("+compile") == "bf16":  # dense weights: fused on load, as the product does
            fuse_projections(drafts["self"])
            if fmt == "bf16":
                report.data["fusion"] = (
                    staged(report, "fusion", share("fusion"), lambda clock: fusion(plan, device, clock, target)) or {}
                )
            fuse_projections(target)  # (a no-op where the stage fused it)
        if index == 0 or compiled(fmt):
            report.data["profile"][fmt] = (
                staged(
                    report, f"profile {fmt}", share("profile"), lambda clock: profile(plan, device, clock, target, fmt)
                )
                or {}
            )
        costs = staged(
            report,
            f"pass_costs {fmt}",
            per_format * 0.4,
            lambda clock: pass_costs(plan, device, clock, target, drafts, fmt, bandwidth),
        )
        report.data["pass_costs"][fmt] = costs or {"error": report.data.get("errors", {}).get(f"pass_costs {fmt}", "")}
        runs = staged(
            report,
            f"speed {fmt}",
            per_format * 0.6,
            lambda clock: speed(plan, device, clock, text, target, drafts, costs or {}, fmt),
        )
        report.data["speed"][fmt] = runs or {"error": report.data.get("errors", {}).get(f"speed {fmt}", "")}
        report.save()
        target = None  # (not `del`: the stages' lambdas above name it)
        drafts["self"] = None
        free(device)
    if "peers" not in report.data:
        run_peers()
    report.data["eagle3"] = staged(report, "eagle3", share("eagle3"), lambda clock: eagle3(plan, device)) or {}
    report.data["seconds"] = round(time.perf_counter() - started, 1)
    report.save()
    log(f"done in {report.data['seconds']} s: {args.out / 'gpu_check.md'}")
    print((args.out / "gpu_check.md").read_text())
    return 1 if report.data.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
