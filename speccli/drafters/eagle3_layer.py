"""The EAGLE-3 draft head, in the layout the published heads are saved in (SafeAILab's
`cnets.py`, vLLM's and SGLang's `llama_eagle3.py`).

The head reads three of the target's features at once: the residual stream entering
three of its decoder layers, concatenated ([n, 3H]), which `fc` folds into one [n, H].
Its single decoder layer attends over 2H: the normed embedding of the next token and the
normed folded feature, embedding first; the folded feature is the residual. Its own norm
and output layer give logits over a draft vocabulary (`draft_vocab_size` ids, mapped to the
target's by `d2t`). A later draft step feeds back the layer's own output (width H, pre-norm)
instead of target features, with `fc` skipped.

The attention is written here (not a transformers decoder layer) because its projections
take 2H inputs while its residual is H wide, which no transformers layer does; its cache is
the two tensors it appends to, cropped on rollback."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class HeadCache:
    """One attention layer's keys and values [1, kv_heads, entries, head_dim]."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.keys is None else int(self.keys.shape[2])

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is None or self.values is None:
            self.keys, self.values = keys, values
        else:
            self.keys = torch.cat([self.keys, keys], dim=2)
            self.values = torch.cat([self.values, values], dim=2)
        return self.keys, self.values

    def crop(self, count: int) -> None:
        """As transformers' DynamicCache.crop: a negative count removes that many entries from
        the end, a positive one keeps that many."""
        if self.keys is not None and self.values is not None:
            keep = len(self) + count if count < 0 else count
            self.keys = self.keys[:, :, : max(0, keep)]
            self.values = self.values[:, :, : max(0, keep)]


def causal_visibility(new: int, cached: int, device: torch.device) -> torch.Tensor:
    """[new, cached + new] bool: every cached entry, and the new ones up to each's own."""
    rows = torch.arange(new, device=device)[:, None]
    cols = torch.arange(cached + new, device=device)[None]
    return cols <= rows + cached


class Eagle3Attention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // self.heads
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(2 * hidden, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(2 * hidden, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(2 * hidden, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=bias)

    def forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        cache: HeadCache | None,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *rotary)
        cached = 0
        if cache is not None:
            cached = len(cache)
            k, v = cache.append(k, v)
        if mask is None:
            mask = causal_visibility(n, cached, x.device)
        repeat = self.heads // self.kv_heads
        if repeat > 1:
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


class Eagle3Layer(nn.Module):
    """The head's one decoder layer, whose input is [normed embedding, normed feature]."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = LlamaRMSNorm(hidden, eps=eps)
        self.hidden_norm = LlamaRMSNorm(hidden, eps=eps)
        self.post_attention_layernorm = LlamaRMSNorm(hidden, eps=eps)
        self.self_attn = Eagle3Attention(config)
        self.mlp = LlamaMLP(config)


class Eagle3Head(nn.Module):
    """Module names follow the published files (`fc`, `midlayer.*`, `norm`, `lm_head`), so
    their state dicts load as they are; `d2t`/`t2d` are read apart (the draft vocabulary)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

        hidden = config.hidden_size
        eps = config.rms_norm_eps
        features = 3 * (getattr(config, "target_hidden_size", None) or hidden)
        self.fc = nn.Linear(features, hidden, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.norm = LlamaRMSNorm(hidden, eps=eps)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        self.rotary = LlamaRotaryEmbedding(config)
        # speculators' variant: the residual is the normed feature, not the feature.
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))

    @property
    def hidden_size(self) -> int:
        return self.fc.out_features

    def new_cache(self) -> HeadCache:
        return HeadCache()

    def forward(
        self,
        features: torch.Tensor,
        embeddings: torch.Tensor,
        positions: torch.Tensor,
        cache: HeadCache | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """features [b, n, 3H] (the target's) or [b, n, H] (this head's own earlier output),
        embeddings [b, n, H] of the tokens after them, positions [b, n]; attention_mask
        additive or bool, over the cached entries and these. Returns [b, n, H], pre-norm."""
        layer = self.midlayer
        hidden = features if features.shape[-1] == self.hidden_size else self.fc(features)
        normed = layer.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([layer.input_layernorm(embeddings), normed], dim=-1)
        rotary = self.rotary(x, positions)
        mask = attention_mask
        if mask is not None and mask.dtype != torch.bool:
            mask = mask.to(x.dtype)
        hidden = residual + layer.self_attn(x, rotary, cache, mask)
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] pre-norm output -> [..., draft_vocab_size] logits."""
        return self.lm_head(self.norm(hidden))
