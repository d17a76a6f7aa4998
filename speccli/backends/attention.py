"""Attention over the filled part of a static cache, without copying grouped keys and values.

A transformers `StaticCache` hands every layer its whole capacity of keys and values, and
transformers' SDPA attention attends over all of it (the mask hides the empty slots), so a
pass at 300 tokens of context pays for 4,096. And for a model with grouped-query attention
(n_rep query heads per key/value head), a pass of more than one token with a mask copies
every key and value n_rep times (`repeat_kv`) before the kernel runs.

The static backend (speccli.backends.static) switches a model whose attention is SDPA to
`WINDOW_SDPA`, registered here, and passes masks that say what to do:

* **The window** is the mask's width W (a bucket of `window_for`, at least the context
  after the pass): keys and values are sliced to their first W slots, a view.
* **Grouped queries** instead of repeated keys: the n_rep query heads of a group are stacked
  as extra query rows of their key/value head ([1, H, n, d] -> [1, H_kv, n_rep * n, d],
  row r * n + i being head r of the group at token i), which every SDPA kernel runs as is;
  the backend tiles the mask to match once per pass (`pack_mask`), so a mask with
  n_rep * n rows marks a packed pass.

Any other call (a 2-D mask made into 4-D by transformers for `generate`, no mask) goes to
transformers' own SDPA function unchanged, so the same model still runs `generate` as before.
Slots past the context hold finite values (zeros, or rolled-back entries) and the mask gives
them a weight of exactly 0, so a window changes which zeros are summed, not the result.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

WINDOW_SDPA = "specgen_window_sdpa"
# Context buckets: a pass attends over the smallest that holds its context, so a graph is
# captured per bucket rather than per length. Past the last, the capacity (a power of two
# times the first cache size) is the window.
WINDOW_BUCKETS = (256, 512, 1024, 2048, 4096)

_registered = False


def windowed_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; query [B, H, n, d], key/value
    [B, H_kv, slots, d]; returns [B, n, H, d]."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, heads, n, _ = query.shape
    groups = key.shape[1]
    rep = heads // groups
    packed = attention_mask is not None and attention_mask.dim() == 4 and rep > 1 and attention_mask.shape[2] == rep * n
    narrower = attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[-1] < key.shape[2]
    if attention_mask is None or not (packed or narrower):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    width = attention_mask.shape[-1]
    key, value = key[:, :, :width], value[:, :, :width]
    if rep > 1:
        query = query.reshape(batch, groups, rep * n, query.shape[-1])
        if not packed and attention_mask.shape[2] != 1:
            attention_mask = pack_mask(attention_mask, rep)
    output = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling
    )
    output = output.reshape(batch, heads, n, value.shape[-1]).transpose(1, 2).contiguous()
    return output, None


def pack_mask(mask: torch.Tensor, rep: int) -> torch.Tensor:
    """[B, 1, n, W] -> [B, 1, rep * n, W]: row r * n + i is row i (the rows of head r of a
    group, as `windowed_sdpa` stacks them)."""
    return mask if rep == 1 else mask.repeat(1, 1, rep, 1)


def window_for(length: int, capacity: int) -> int:
    """The slots a pass attends over when the context after it is `length` tokens."""
    for bucket in WINDOW_BUCKETS:
        if length <= bucket:
            return min(bucket, capacity)
    return capacity


def query_groups(config) -> int:
    """Query heads per key/value head (1 without grouped-query attention)."""
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return heads // kv_heads if heads and kv_heads else 1


def use_windowed_attention(model: PreTrainedModel) -> bool:
    """Switch a model whose attention is SDPA to `WINDOW_SDPA` (registering it once);
    True when it runs it now. Other implementations are left as they are."""
    global _registered
    attention = getattr(model.config, "_attn_implementation", None)
    if attention == WINDOW_SDPA:
        return True
    if attention != "sdpa":
        return False
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(WINDOW_SDPA, windowed_sdpa)
        AttentionMaskInterface.register(WINDOW_SDPA, sdpa_mask)
        _registered = True
    model.set_attn_implementation(WINDOW_SDPA)
    return True
