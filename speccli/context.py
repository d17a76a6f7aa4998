"""Whether a prompt fits the model's context: the one check, with a typed error."""

from __future__ import annotations


class ContextOverflowError(ValueError):
    """A prompt that leaves no room in the model's context for a new token (the commands
    tell the user, each in its own words)."""

    def __init__(self, prompt_tokens: int, context: int) -> None:
        super().__init__(f"the prompt is {prompt_tokens} tokens long and the model's context holds {context}")
        self.prompt_tokens = prompt_tokens
        self.context = context


def check_fits(prompt_tokens: int, context: int | None) -> None:
    """Raise ContextOverflowError unless a prompt this long leaves room for a new token."""
    if context is not None and prompt_tokens >= context:
        raise ContextOverflowError(prompt_tokens, context)
