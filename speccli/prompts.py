"""The one prompt encoder: raw text, or a conversation under the model's chat template.

Every surface (generate, chat, bench, scripts/) turns what the user gave into token ids
here, so a conversation is rendered the same way everywhere: control tokens a user types
are encoded as text, and a template that refuses a system message gets it prepended to
the first user message instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from speccli.errors import UsageError

Message = dict[str, str]


class PromptError(UsageError):
    """A prompt this model cannot take: no chat template, or a template that refuses it."""


class NoChatTemplateError(PromptError):
    def __init__(self) -> None:
        super().__init__("this model has no chat template", "run without --chat, or use an instruction-tuned model")


@dataclass(frozen=True)
class Prompt:
    """What to generate from: `text` as it is, or `messages` under the chat template
    (ending with the header of the assistant's answer). `system`, if given, comes first
    unless the messages already hold a system message."""

    text: str | None = None
    messages: tuple[Message, ...] | None = None
    system: str | None = None

    def __post_init__(self) -> None:
        if (self.text is None) == (self.messages is None):
            raise ValueError("a Prompt needs exactly one of text and messages")

    @classmethod
    def of(cls, text: str, chat: bool = False, system: str | None = None) -> Prompt:
        """`text` as it is, or (`chat`) as the one user message of a conversation."""
        if not chat:
            return cls(text=text)
        return cls(messages=({"role": "user", "content": text},), system=system)

    @classmethod
    def conversation(cls, messages: Sequence[Message], system: str | None = None) -> Prompt:
        return cls(messages=tuple(dict(m) for m in messages), system=system)

    def conversation_messages(self) -> list[Message]:
        messages = [dict(m) for m in self.messages or ()]
        if self.system and not any(m["role"] == "system" for m in messages):
            messages.insert(0, {"role": "system", "content": self.system})
        return messages


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def encode_prompt(tokenizer, prompt: Prompt) -> list[int]:
    """Token ids of `prompt`. Raises NoChatTemplateError or PromptError for messages the
    model cannot render."""
    if prompt.messages is None:
        return list(tokenizer(prompt.text)["input_ids"])
    if not has_chat_template(tokenizer):
        raise NoChatTemplateError()
    return encode_conversation(tokenizer, prompt.conversation_messages())


def _rendered_ids(tokenizer, messages: list[Message]) -> list[int]:
    kwargs = dict(add_generation_prompt=True, tokenize=True)
    try:
        # Control tokens a user types (say "<|im_end|>") are encoded as text, not as tokens.
        ids = tokenizer.apply_chat_template(messages, sanitize_control_tokens=True, **kwargs)
    except TypeError:
        ids = tokenizer.apply_chat_template(messages, **kwargs)
    if hasattr(ids, "keys"):  # a BatchEncoding
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def encode_conversation(tokenizer, messages: list[Message]) -> list[int]:
    """Token ids of a conversation under the model's chat template, ending with the header
    of the assistant's next answer. A template that refuses a system message (some do)
    gets it prepended to the first user message instead."""
    try:
        return _rendered_ids(tokenizer, messages)
    except Exception as error:  # jinja2 TemplateError, or raise_exception() in a template
        if messages and messages[0]["role"] == "system" and len(messages) > 1:
            system, rest = messages[0]["content"], [dict(m) for m in messages[1:]]
            first_user = next((m for m in rest if m["role"] == "user"), None)
            if first_user is not None:
                first_user["content"] = f"{system}\n\n{first_user['content']}"
                try:
                    return _rendered_ids(tokenizer, rest)
                except Exception:
                    pass
        raise PromptError(f"the model's chat template refused the conversation: {error}") from None
