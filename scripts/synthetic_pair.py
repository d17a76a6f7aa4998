"""Write random-weight models of real shapes, with a real tokenizer, for timing runs.

    python scripts/synthetic_pair.py OUT [--scale real|tiny] [--tokenizer NAME|FOLDER|GGUF]
                                         [--device cpu|cuda] [--dtype bfloat16]

OUT gets three model folders that load like any local model (`--target OUT/target`):

  target      Qwen2.5-7B-shaped: hidden 3584, 28 layers, 28 heads, 4 kv heads,
              intermediate 18944, vocabulary 152064 rows.
  draft       an independent Qwen2.5-0.5B-shaped draft: hidden 896, 24 layers, 14 heads,
              2 kv heads, intermediate 4864, 151936 rows (tied embeddings). Random against
              random: it is almost never accepted; it times the draft's passes.
  self-draft  the target's embeddings, first --self-layers layers, final norm and head. In the
              target the output projections (o_proj, down_proj) of the later layers are scaled
              by --later-scale, so those layers barely move the residual stream and target and
              self draft agree on most greedy tokens (the agreement on a few prompts is printed).

--scale tiny gives the same structure in small shapes (the full vocabulary stays, so the
real tokenizer fits): it writes in seconds on a CPU, for testing this script and
scripts/gpu_benchmark.sh's CPU path. The tokenizer (default: the offline Qwen2.5 package's,
converted from its GGUF once and cached by specgen) is saved into each folder; on a machine
without the GGUF pass a tokenizer folder (`--export-tokenizer DIR` writes one here).

Weights are random (normal, std --init-std) and made on --device: on a GPU a 7B model is
made in seconds where a CPU takes minutes. Nothing here is a trained model: use it for
timings and for checking that outputs agree, not for text.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

QWEN_EOS = ("<|endoftext|>", "<|im_end|>")

SHAPES = {
    "real": {
        "target": dict(
            hidden_size=3584,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            intermediate_size=18944,
            vocab_size=152064,
            tie_word_embeddings=False,
        ),
        "draft": dict(
            hidden_size=896,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            intermediate_size=4864,
            vocab_size=151936,
            tie_word_embeddings=True,
        ),
        "self_layers": 4,
    },
    "tiny": {
        "target": dict(
            hidden_size=64,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            vocab_size=152064,
            tie_word_embeddings=False,
        ),
        "draft": dict(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            intermediate_size=64,
            vocab_size=151936,
            tie_word_embeddings=True,
        ),
        "self_layers": 2,
    },
}


def log(message: str) -> None:
    print(f"synthetic_pair: {message}", file=sys.stderr, flush=True)


def load_tokenizer(name: str):
    """A folder with tokenizer files, or anything specgen resolves (alias, .gguf, hub id)."""
    from transformers import AutoTokenizer

    path = Path(name)
    if path.is_dir() and (path / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(path)
    from speccli.config import LoadConfig
    from speccli.models.loading import load_tokenizer as specgen_tokenizer

    return specgen_tokenizer(name, LoadConfig(device="cpu"), progress=log).tokenizer


def qwen_config(shape: dict, tokenizer, max_positions: int, init_std: float):
    from transformers import Qwen2Config

    eos = [tokenizer.convert_tokens_to_ids(t) for t in QWEN_EOS if t in tokenizer.get_vocab()]
    eos = eos or [tokenizer.eos_token_id]
    return Qwen2Config(
        **shape,
        max_position_embeddings=max_positions,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        initializer_range=init_std,
        bos_token_id=tokenizer.bos_token_id if tokenizer.bos_token_id is not None else eos[0],
        eos_token_id=eos,
        use_sliding_window=False,
    )


def make_model(config, device: torch.device, dtype: torch.dtype, seed: int):
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.eos_token_id[0]
    model.generation_config.do_sample = False
    return model.eval()


def spread_logits(model, factor: float) -> None:
    """Random heads give near-uniform logits: scale the head so greedy choices have margins."""
    with torch.no_grad():
        model.lm_head.weight.mul_(factor)


def make_self_draft(target, layers: int, later_scale: float, device, dtype):
    """Scale the target's later layers' output projections down; copy its first layers,
    embeddings, norm and head into a shallower model."""
    from copy import deepcopy

    with torch.no_grad():
        for layer in target.model.layers[layers:]:
            layer.self_attn.o_proj.weight.mul_(later_scale)
            layer.mlp.down_proj.weight.mul_(later_scale)
    config = deepcopy(target.config)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    draft = make_model(config, device, dtype, seed=0)
    state = {
        k: v
        for k, v in target.state_dict().items()
        if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers
    }
    draft.load_state_dict(state)
    return draft


def agreement(target, draft, tokenizer, device, new_tokens: int = 32) -> float:
    """The share of the target's greedy tokens the draft also picks, teacher-forced on the
    target's own continuations of a few prompts."""
    prompts = ["def fib(n):", "The capital of France is", "for i in range(10):", "SELECT * FROM users WHERE"]
    same = total = 0
    for prompt in prompts:
        ids = torch.tensor([tokenizer(prompt)["input_ids"]], device=device)
        with torch.inference_mode():
            out = target.generate(ids, max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens)
            target_choice = target(input_ids=out).logits[0, ids.shape[1] - 1 : -1].argmax(-1)
            draft_choice = draft(input_ids=out).logits[0, ids.shape[1] - 1 : -1].argmax(-1)
        same += int((target_choice == draft_choice).sum())
        total += int(target_choice.numel())
    return same / total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, nargs="?")
    parser.add_argument("--scale", choices=sorted(SHAPES), default="real")
    parser.add_argument(
        "--tokenizer",
        default="qwen2.5-coder-0.5b",
        help="a tokenizer folder, or a model specgen resolves (default: the offline Qwen2.5 package)",
    )
    parser.add_argument(
        "--export-tokenizer",
        type=Path,
        default=None,
        help="only save the tokenizer into this folder (to carry to a machine without the GGUF)",
    )
    parser.add_argument("--device", default="cpu", help="where the random weights are made (cuda is much faster)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--self-layers", type=int, default=None, help="layers of the self draft (real: 4, tiny: 2)")
    parser.add_argument(
        "--later-scale",
        type=float,
        default=0.05,
        help="factor on the output projections of the target's layers past --self-layers",
    )
    parser.add_argument("--logit-scale", type=float, default=8.0, help="factor on the heads' weights")
    parser.add_argument("--init-std", type=float, default=0.02)
    parser.add_argument("--max-positions", type=int, default=32768)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-check", action="store_true", help="skip measuring target/self-draft agreement")
    args = parser.parse_args()

    tokenizer = load_tokenizer(args.tokenizer)
    if args.export_tokenizer is not None:
        tokenizer.save_pretrained(args.export_tokenizer)
        log(f"tokenizer saved in {args.export_tokenizer}")
        return 0
    if args.out is None:
        parser.error("OUT is required (unless --export-tokenizer)")
    shapes = SHAPES[args.scale]
    self_layers = args.self_layers or shapes["self_layers"]
    if not 0 < self_layers < shapes["target"]["num_hidden_layers"]:
        parser.error(f"--self-layers must be between 1 and {shapes['target']['num_hidden_layers'] - 1}")
    if len(tokenizer) > shapes["draft"]["vocab_size"]:
        parser.error(f"the tokenizer's {len(tokenizer)} tokens do not fit the models' vocabulary")
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    started = time.perf_counter()

    target = make_model(
        qwen_config(shapes["target"], tokenizer, args.max_positions, args.init_std), device, dtype, args.seed
    )
    spread_logits(target, args.logit_scale)
    self_draft = make_self_draft(target, self_layers, args.later_scale, device, dtype)
    draft = make_model(
        qwen_config(shapes["draft"], tokenizer, args.max_positions, args.init_std), device, dtype, args.seed + 1
    )
    spread_logits(draft, args.logit_scale)
    log(f"made {args.scale} models on {device} in {time.perf_counter() - started:.1f} s")

    info = {
        "scale": args.scale,
        "dtype": args.dtype,
        "self_layers": self_layers,
        "later_scale": args.later_scale,
        "logit_scale": args.logit_scale,
        "seed": args.seed,
    }
    if not args.no_check:
        info["self_draft_agreement"] = agreement(target, self_draft, tokenizer, device)
        info["draft_agreement"] = agreement(target, draft, tokenizer, device)
        log(
            f"greedy agreement with the target: self draft {info['self_draft_agreement']:.0%},"
            f" independent draft {info['draft_agreement']:.0%}"
        )
    for name, model in (("target", target), ("draft", draft), ("self-draft", self_draft)):
        folder = args.out / name
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        params = sum(p.numel() for p in model.parameters())
        info[name] = {"parameters": params, "folder": str(folder)}
        log(f"wrote {folder} ({params / 1e9:.2f} B parameters)")
    (args.out / "synthetic.json").write_text(json.dumps(info, indent=2))
    log(f"done in {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
