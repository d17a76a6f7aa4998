"""Reference draft heads in the published layouts, written from the sources (SafeAILab/EAGLE
`cnets.py` for EAGLE-3, `cnets1.py` for EAGLE-1/2, FasterDecoding/Medusa `medusa_model.py`)
and nothing of speccli: plain tensors under the published key names, a whole-sequence
forward (no cache), training on a target's features, and acceptance measured by drafting
and checking against the target's greedy continuation as a speculative decoder would.

Each forward can be wired wrongly on purpose (`wiring`), as the reported bugs are: the
features from the wrong layers, the concatenation swapped, EAGLE-1's feature taken before
the final norm, a Medusa head read one position off. A wrongly wired head stays lossless;
only its acceptance shows it."""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F

IGNORE = -100


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotary embedding of x [heads, n, d] at positions 0..n-1 (Llama's rotate-half form)."""
    d, n = x.shape[-1], x.shape[-2]
    inverse = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = torch.arange(n, dtype=torch.float32)[:, None] * inverse[None]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    rotated = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + rotated * sin


def attention(w: dict, prefix: str, x: torch.Tensor, heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    n = x.shape[0]
    q = (x @ w[f"{prefix}q_proj.weight"].T).view(n, heads, head_dim).transpose(0, 1)
    k = (x @ w[f"{prefix}k_proj.weight"].T).view(n, kv_heads, head_dim).transpose(0, 1)
    v = (x @ w[f"{prefix}v_proj.weight"].T).view(n, kv_heads, head_dim).transpose(0, 1)
    q, k = rope(q), rope(k)
    k, v = k.repeat_interleave(heads // kv_heads, 0), v.repeat_interleave(heads // kv_heads, 0)
    out = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]
    return out.transpose(0, 1).reshape(n, heads * head_dim) @ w[f"{prefix}o_proj.weight"].T


def mlp(w: dict, prefix: str, x: torch.Tensor) -> torch.Tensor:
    gate, up = x @ w[f"{prefix}gate_proj.weight"].T, x @ w[f"{prefix}up_proj.weight"].T
    return (F.silu(gate) * up) @ w[f"{prefix}down_proj.weight"].T


def _linear(rows: int, cols: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(rows, cols, generator=generator) / cols**0.5


# --------------------------------------------------------------------------- EAGLE-3


def eagle3_init(hidden: int, intermediate: int, heads: int, kv_heads: int, draft_vocab: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    d = hidden // heads
    w = {
        "fc.weight": _linear(hidden, 3 * hidden, g),
        "midlayer.input_layernorm.weight": torch.ones(hidden),
        "midlayer.hidden_norm.weight": torch.ones(hidden),
        "midlayer.post_attention_layernorm.weight": torch.ones(hidden),
        "midlayer.self_attn.q_proj.weight": _linear(heads * d, 2 * hidden, g),
        "midlayer.self_attn.k_proj.weight": _linear(kv_heads * d, 2 * hidden, g),
        "midlayer.self_attn.v_proj.weight": _linear(kv_heads * d, 2 * hidden, g),
        "midlayer.self_attn.o_proj.weight": _linear(hidden, heads * d, g),
        "midlayer.mlp.gate_proj.weight": _linear(intermediate, hidden, g),
        "midlayer.mlp.up_proj.weight": _linear(intermediate, hidden, g),
        "midlayer.mlp.down_proj.weight": _linear(hidden, intermediate, g),
        "norm.weight": torch.ones(hidden),
        "lm_head.weight": _linear(draft_vocab, hidden, g),
    }
    return {k: v.requires_grad_() for k, v in w.items()}


def eagle3_forward(
    w: dict, features: torch.Tensor, embeddings: torch.Tensor, heads: int, kv_heads: int, swapped: bool = False
) -> torch.Tensor:
    """Rows of [feature (3H from the target, or H: the head's own output), embedding of the
    next token] -> the layer's pre-norm output [n, H]."""
    hidden = embeddings.shape[-1]
    folded = torch.stack([f if f.shape[-1] == hidden else w["fc.weight"] @ f for f in features])
    parts = [rms(embeddings, w["midlayer.input_layernorm.weight"]), rms(folded, w["midlayer.hidden_norm.weight"])]
    x = torch.cat(parts[::-1] if swapped else parts, -1)
    h = folded + attention(w, "midlayer.self_attn.", x, heads, kv_heads, hidden // heads)
    return h + mlp(w, "midlayer.mlp.", rms(h, w["midlayer.post_attention_layernorm.weight"]))


def eagle3_logits(w: dict, h: torch.Tensor) -> torch.Tensor:
    return rms(h, w["norm.weight"]) @ w["lm_head.weight"].T


# --------------------------------------------------------------------------- EAGLE-1/2


def eagle_init(hidden: int, intermediate: int, heads: int, kv_heads: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    d = hidden // heads
    eye = torch.cat([torch.zeros(hidden, hidden), torch.eye(hidden)], 1)  # starts passing the feature through
    w = {
        "fc.weight": eye + 0.01 * _linear(hidden, 2 * hidden, g),
        "fc.bias": torch.zeros(hidden),
        "layers.0.self_attn.q_proj.weight": _linear(heads * d, hidden, g),
        "layers.0.self_attn.k_proj.weight": _linear(kv_heads * d, hidden, g),
        "layers.0.self_attn.v_proj.weight": _linear(kv_heads * d, hidden, g),
        "layers.0.self_attn.o_proj.weight": 0.1 * _linear(hidden, heads * d, g),
        "layers.0.mlp.gate_proj.weight": _linear(intermediate, hidden, g),
        "layers.0.mlp.up_proj.weight": _linear(intermediate, hidden, g),
        "layers.0.mlp.down_proj.weight": 0.1 * _linear(hidden, intermediate, g),
        "layers.0.post_attention_layernorm.weight": torch.ones(hidden),
    }
    return {k: v.requires_grad_() for k, v in w.items()}


def eagle_forward(
    w: dict, features: torch.Tensor, embeddings: torch.Tensor, heads: int, kv_heads: int, swapped: bool = False
) -> torch.Tensor:
    """Rows of [feature (post-norm, H), embedding of the next token] -> the predicted
    feature of the next token [n, H] (no input norm, no final norm: cnets1.py)."""
    hidden = embeddings.shape[-1]
    parts = [embeddings, torch.stack(list(features))]
    x = torch.cat(parts[::-1] if swapped else parts, -1) @ w["fc.weight"].T + w["fc.bias"]
    h = x + attention(w, "layers.0.self_attn.", x, heads, kv_heads, hidden // heads)
    return h + mlp(w, "layers.0.mlp.", rms(h, w["layers.0.post_attention_layernorm.weight"]))


# --------------------------------------------------------------------------- Medusa


def medusa_init(hidden: int, vocab_rows: torch.Tensor, heads: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    w = {}
    for h in range(heads):
        w[f"{h}.0.linear.weight"] = 0.01 * _linear(hidden, hidden, g)
        w[f"{h}.0.linear.bias"] = torch.zeros(hidden)
        w[f"{h}.1.weight"] = vocab_rows.clone()
    return {k: v.requires_grad_() for k, v in w.items()}


def medusa_logits(w: dict, feature: torch.Tensor, head: int) -> torch.Tensor:
    """Head `head` on a feature of position p: logits of the token at p + head + 2."""
    x = feature + F.silu(feature @ w[f"{head}.0.linear.weight"].T + w[f"{head}.0.linear.bias"])
    return x @ w[f"{head}.1.weight"].T


# --------------------------------------------------------------------------- the target's side


def layer_inputs(target, ids: Sequence[int], layers: Sequence[int]) -> torch.Tensor:
    """The residual stream entering `layers` (transformers' hidden_states[i]), concatenated [n, len * H]."""
    with torch.no_grad():
        out = target.model(input_ids=torch.tensor([list(ids)]), output_hidden_states=True)
    return torch.cat([out.hidden_states[i][0] for i in layers], -1)


def final_features(target, ids: Sequence[int], before_norm: bool = False) -> torch.Tensor:
    """The target's last hidden state [n, H]: after its final norm (what its output layer
    reads), or, wired wrongly, before it."""
    seen = {}
    hook = target.model.norm.register_forward_hook(lambda module, args, out: seen.update(before=args[0]))
    try:
        with torch.no_grad():
            after = target.model(input_ids=torch.tensor([list(ids)])).last_hidden_state[0]
    finally:
        hook.remove()
    return seen["before"][0] if before_norm else after


def greedy(target, ids: Sequence[int], n: int) -> list[int]:
    with torch.no_grad():
        out = target.generate(torch.tensor([list(ids)]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids) :].tolist()


def acceptance(
    target, prompts: Sequence[Sequence[int]], k: int, n: int, draft: Callable[[list[int]], list[int]]
) -> float:
    """Mean tokens accepted per step, drafting k with `draft(context)` and checking the
    draft against the target's greedy continuation, n new tokens per prompt."""
    steps = accepted = 0
    for prompt in prompts:
        want = greedy(target, prompt, n)
        context, done = list(prompt), 0
        while done < n:
            guesses = draft(context)[:k]
            hits = 0
            while hits < len(guesses) and done + hits < n and guesses[hits] == want[done + hits]:
                hits += 1
            steps += 1
            accepted += hits
            taken = min(hits + 1, n - done)
            context += want[done : done + taken]
            done += taken
    return accepted / steps
