"""The EAGLE-1 draft head: it drafts in the target's feature space. One decoder layer of the
target's own kind reads fc([embedding of token t+1, feature of token t]) and predicts the
feature of token t+1; the target's output layer turns a feature into token logits, and the
predicted feature feeds the next step. The target's embeddings and output rows are reused,
not trained or saved."""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch
from torch import nn

from speccli.backends.fused import unfused_state_dict


def one_layer_config(target_config: Any) -> Any:
    """The target's config cut to one decoder layer, with no vocabulary of its own (the head
    is fed embeddings, never ids)."""
    config = copy.deepcopy(target_config)
    config.num_hidden_layers = 1
    config.vocab_size = 1
    config.pad_token_id = None
    if getattr(config, "layer_types", None):
        config.layer_types = list(config.layer_types[:1])
    if getattr(config, "max_window_layers", None) is not None:
        config.max_window_layers = min(config.max_window_layers, 1)
    config.tie_word_embeddings = False
    return config


def additive_mask(seen: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[1, 1, n, m] mask to add to the head's attention scores from bool `seen` [n, m]
    (True: attends), as the head's decoder layer takes a mask other than causal."""
    return torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill_(~seen, torch.finfo(dtype).min)[
        None, None
    ]


class EagleHead(nn.Module):
    def __init__(self, target_config: Any, fc_bias: bool = True) -> None:
        super().__init__()
        from transformers import AutoModel

        hidden = target_config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=fc_bias)
        config = one_layer_config(target_config)
        attention = getattr(target_config, "_attn_implementation", None)
        self.body = AutoModel.from_config(config, attn_implementation=attention or "sdpa")
        self.body.get_input_embeddings().requires_grad_(False)  # never read
        params = inspect.signature(self.body.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"

    @property
    def hidden_size(self) -> int:
        return self.fc.out_features

    def new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.body.config)

    def without_input_norms(self) -> "EagleHead":
        """The published EAGLE-1/2 layout: its layer reads fc's output un-normed, and its
        output is the predicted feature as it is (SafeAILab's layer 0 has no input_layernorm;
        the model has no final norm)."""
        self.body.layers[0].input_layernorm = nn.Identity()
        self.body.norm = nn.Identity()
        return self

    def init_from_target(self, target: nn.Module) -> None:
        """Start from the target's last decoder layer and final norm, and an fc that passes
        the feature through: a head that at first reads its input as the target's top layer would."""
        base: Any = target.base_model  # a transformers model's decoder stack
        with torch.no_grad():
            self.body.layers[0].load_state_dict(unfused_state_dict(base.layers[-1]))
            self.body.norm.load_state_dict(base.norm.state_dict())
            hidden = self.hidden_size
            self.fc.weight.zero_()
            self.fc.weight[:, hidden:].copy_(torch.eye(hidden))
            self.fc.weight[:, :hidden].normal_(0.0, 0.02 / hidden**0.5)
            self.fc.bias.zero_()

    def forward(
        self,
        features: torch.Tensor,
        embeddings: torch.Tensor,
        positions: torch.Tensor,
        cache: Any = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """features, embeddings [b, n, hidden] (feature of token t, embedding of token t+1);
        positions [b, n]. Returns the predicted features of tokens t+1 [b, n, hidden]."""
        x = self.fc(torch.cat([embeddings, features], dim=-1))
        kwargs = {"inputs_embeds": x, "position_ids": positions, "use_cache": cache is not None}
        if cache is not None:
            kwargs[self._cache_kwarg] = cache
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        return self.body(**kwargs).last_hidden_state

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """What is saved: everything but the unused embedding."""
        return {k: v for k, v in self.state_dict().items() if "embed_tokens" not in k}


class OutputRows(nn.Module):
    """The target's output rows for a draft vocabulary [len(vocab), hidden], as a layer:
    a feature's logits over that vocabulary."""

    rows: torch.Tensor

    def __init__(self, rows: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("rows", rows, persistent=False)

    def forward(self, feature: torch.Tensor) -> torch.Tensor:
        return torch.matmul(feature, self.rows.T)
