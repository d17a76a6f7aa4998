"""The requests `specgen serve` takes, as typed models, and the one error it answers with.

Field names and ranges follow OpenAI's API. Types are strict (a temperature sent as "0.5"
is refused, as OpenAI refuses it), an argument OpenAI does not define is refused, and an
argument specgen cannot honour exactly (n > 1, penalties, logprobs, tools, a JSON response
format, logit biases) is refused when it asks for anything but its default: a client never
gets an answer that silently ignored what it asked for.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from speccli.config import SamplingConfig, SpecConfig, parse_draft_length
from speccli.prompts import Message, Prompt

# OpenAI's default sampling temperature, for a request that does not say.
DEFAULT_TEMPERATURE = 1.0
# OpenAI's legacy completions answer 16 tokens unless told otherwise; chat answers run to
# the end of the context.
COMPLETIONS_MAX_TOKENS = 16
MAX_STOP_STRINGS = 4


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        detail = ErrorDetail(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorBody(error=detail).model_dump()


def invalid(param: str | None, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class SpecgenOptions(_Strict):
    """specgen's own request extension, under "specgen": how to draft, and whether to send
    every token with its provenance (what `generate --server --json` prints)."""

    k: Union[int, str, None] = None  # None: the server's --k
    tree: Optional[bool] = None  # None: the server's --tree
    tokens: bool = False

    def draft_length(self, default: int | str) -> int | str:
        if self.k is None:
            return default
        try:
            return parse_draft_length(str(self.k))
        except ValueError as error:
            raise invalid("specgen.k", str(error)) from None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[dict[str, Any]], None] = None
    name: Optional[str] = None
    # An assistant message that called tools is a conversation specgen cannot continue.
    tool_calls: Optional[list[Any]] = None
    refusal: Optional[str] = None

    def as_message(self, index: int) -> Message:
        if self.tool_calls:
            raise invalid(
                f"messages.[{index}].tool_calls", "tool calls are not supported by specgen", "unsupported_parameter"
            )
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": self._text(index)}

    def _text(self, index: int) -> str:
        if self.content is None:
            if self.role == "assistant":
                return ""
            raise invalid(f"messages.[{index}].content", f"a {self.role} message needs content")
        if isinstance(self.content, str):
            return self.content
        texts = []
        for number, part in enumerate(self.content):
            kind = part.get("type")
            if kind != "text" or not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
                raise invalid(
                    f"messages.[{index}].content.[{number}]",
                    f"only text content parts are supported by specgen, got {kind!r}",
                    "unsupported_parameter" if kind != "text" else "invalid_value",
                )
            texts.append(part["text"])
        return "".join(texts)


class _GenerationRequest(_Strict):
    """What chat and text completions share."""

    model: str
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=0)  # an extension, as vLLM's and llama.cpp's servers take it
    seed: Optional[int] = Field(None, ge=-(1 << 63), lt=1 << 63)  # what OpenAI takes: a 64-bit integer
    stop: Union[str, list[str], None] = None
    n: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None  # no effect on the answer
    specgen: SpecgenOptions = Field(default_factory=SpecgenOptions)

    def unsupported(self) -> APIError | None:
        """The first argument asking for something specgen cannot honour exactly."""
        if self.n not in (None, 1):
            return invalid(
                "n", "specgen generates one answer per request (batch size 1): n must be 1", "unsupported_value"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0):
                return invalid(
                    name,
                    f"{name} changes the target's distribution, which specgen keeps exact: it must be 0",
                    "unsupported_value",
                )
        if self.logit_bias:
            return invalid(
                "logit_bias",
                "logit_bias changes the target's distribution, which specgen keeps exact",
                "unsupported_value",
            )
        if self.stream_options is not None and not self.stream:
            return invalid("stream_options", "stream_options is only allowed with stream: true")
        return None

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise invalid("stop", f"at most {MAX_STOP_STRINGS} stop sequences, got {len(stops)}")
        if any(not s for s in stops):
            raise invalid("stop", "stop sequences must not be empty")
        return tuple(stops)

    def sampling(self) -> SamplingConfig:
        temperature = DEFAULT_TEMPERATURE if self.temperature is None else self.temperature
        return SamplingConfig(temperature, self.top_k or 0, 1.0 if self.top_p is None else self.top_p, self.seed)

    def requested_tokens(self) -> int | None:
        return self.max_tokens

    def spec(
        self, prompt_tokens: int, context: int | None, defaults: SpecConfig, default_max_tokens: int | None
    ) -> SpecConfig:
        """The generation's settings: the server's `defaults` (k, tree) where the request's
        `specgen` object says nothing; without a token limit, the answer may fill the context."""
        max_new = self.requested_tokens() or default_max_tokens
        if max_new is None:
            max_new = max(1, context - prompt_tokens) if context is not None else 1 << 20
        tree = defaults.tree if self.specgen.tree is None else self.specgen.tree
        return SpecConfig(
            k=self.specgen.draft_length(defaults.k),
            max_new_tokens=max_new,
            stop_strings=self.stop_strings(),
            tree=tree,
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None
    tools: Optional[list[Any]] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None
    functions: Optional[list[Any]] = None
    function_call: Union[str, dict[str, Any], None] = None
    response_format: Optional[dict[str, Any]] = None
    store: Optional[bool] = None
    metadata: Optional[dict[str, str]] = None

    def unsupported(self) -> APIError | None:
        shared = super().unsupported()
        if shared is not None:
            return shared
        if self.logprobs or self.top_logprobs:
            return invalid("logprobs", "logprobs are not supported by specgen", "unsupported_value")
        if self.tools or self.functions:
            return invalid("tools", "tools are not supported by specgen", "unsupported_parameter")
        for name in ("tool_choice", "function_call"):
            if getattr(self, name) not in (None, "none", "auto"):
                return invalid(name, f"{name} needs tools, which specgen does not support", "unsupported_value")
        if self.response_format is not None and self.response_format.get("type") != "text":
            return invalid(
                "response_format", "only the text response format is supported by specgen", "unsupported_value"
            )
        return None

    def requested_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def prompt(self) -> Prompt:
        return Prompt.conversation([m.as_message(i) for i, m in enumerate(self.messages)])


class CompletionRequest(_GenerationRequest):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None
    logprobs: Optional[int] = None

    def unsupported(self) -> APIError | None:
        shared = super().unsupported()
        if shared is not None:
            return shared
        if self.echo:
            return invalid("echo", "echo is not supported by specgen", "unsupported_value")
        if self.suffix:
            return invalid("suffix", "suffix (insertion) is not supported by specgen", "unsupported_value")
        if self.best_of not in (None, 1):
            return invalid(
                "best_of", "specgen generates one answer per request: best_of must be 1", "unsupported_value"
            )
        if self.logprobs:
            return invalid("logprobs", "logprobs are not supported by specgen", "unsupported_value")
        return None

    def prompt_of(self, vocab_size: int) -> Prompt | list[int]:
        """The text prompt, or the token ids it already is."""
        prompt: Any = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise invalid("prompt", "specgen takes one prompt per request (batch size 1)", "unsupported_value")
            prompt = prompt[0]
        if not prompt:
            raise invalid("prompt", "the prompt is empty")
        if isinstance(prompt, str):
            return Prompt(text=prompt)
        ids: list[int] = list(prompt)
        if any(not 0 <= token < vocab_size for token in ids):
            raise invalid("prompt", f"token ids must lie in 0..{vocab_size - 1}")
        return ids


# ---------------------------------------------------------------------------------------------
# Responses: OpenAI's objects, typed. Fields OpenAI sends as null are kept (clients read them).


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PromptTokensDetails(_Out):
    cached_tokens: int


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class AssistantMessage(_Out):
    role: Literal["assistant"] = "assistant"
    content: Optional[str]
    refusal: Optional[str] = None


class ChatChoice(_Out):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: Optional[str]


class Delta(_Out):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None


class ChunkChoice(_Out):
    index: int = 0
    delta: Delta
    logprobs: None = None
    finish_reason: Optional[str] = None


class TextChoice(_Out):
    text: str
    index: int = 0
    logprobs: None = None
    finish_reason: Optional[str] = None


class _Completion(_Out):
    id: str
    created: int
    model: str
    system_fingerprint: None = None
    usage: Optional[Usage] = None
    # specgen's figures (see speccli.serve.responses.figures); per-token records on a chunk.
    specgen: Optional[dict[str, Any]] = None


class ChatCompletion(_Completion):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class ChatCompletionChunk(_Completion):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChunkChoice]


class TextCompletion(_Completion):
    object: Literal["text_completion"] = "text_completion"
    choices: list[TextChoice]


class ModelCard(_Out):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specgen"
    specgen: dict[str, Any]


class ModelList(_Out):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(_Out):
    message: str
    type: str
    param: Optional[str]
    code: Optional[str]


class ErrorBody(_Out):
    error: ErrorDetail
