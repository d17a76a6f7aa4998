"""The HTTP side of `specgen serve`: OpenAI's routes over a GenerationService, on Starlette.

Every answer that is not a success is OpenAI's error object with the status OpenAI gives it
(400 bad request, 401 no or wrong key, 404 unknown model or route, 413 body too large, 503
queue full or stopping, 500 a fault of specgen's own), and no traceback reaches a client.
"""

from __future__ import annotations

import asyncio
import copy
import hmac
import json
import threading
from typing import Callable

from pydantic import ValidationError
from sse_starlette.sse import EventSourceResponse
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from speccli.config import AUTO_K, SpecConfig
from speccli.context import ContextOverflowError, check_fits
from speccli.prompts import Prompt, PromptError, encode_prompt
from speccli.serve.responses import Reply, Served, figures, usage
from speccli.serve.schema import (
    COMPLETIONS_MAX_TOKENS,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ModelList,
    invalid,
)
from speccli.serve.service import Failed, Finished, GenerationService, Job, QueueFull, ShuttingDown, Token, Update

MAX_BODY_BYTES = 4 << 20
# pydantic's names for the members of a Union in an error's location: not parameter names.
_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


class PromptEncoder:
    """Prompts to token ids on the request's side, with a tokenizer of its own: the worker's
    tokenizer is busy detokenizing, and a Rust tokenizer refuses use from two threads at once."""

    def __init__(self, tokenizer, context: int | None) -> None:
        try:
            self._tokenizer = copy.deepcopy(tokenizer)
        except Exception:  # noqa: BLE001 - a tokenizer that cannot be copied is shared, under the lock
            self._tokenizer = tokenizer
        self._lock = threading.Lock()
        self.context = context

    def encode(self, prompt: Prompt | list[int]) -> list[int]:
        if isinstance(prompt, Prompt):
            with self._lock:
                ids = encode_prompt(self._tokenizer, prompt)
        else:
            ids = list(prompt)
        if not ids:
            raise invalid("prompt", "the prompt encodes to no tokens")
        check_fits(len(ids), self.context)
        return ids


def validation_error(error: ValidationError) -> APIError:
    """A pydantic error as OpenAI words it, naming the parameter."""
    first = error.errors()[0]
    kind = first["type"]
    parts: list[str] = []
    for part in first["loc"]:
        if isinstance(part, int):
            parts.append(f"[{part}]")
        elif part not in _UNION_TAGS and "[" not in part and "-" not in part:
            parts.append(part)
    param = ".".join(parts) or None
    if kind in ("json_invalid", "json_type"):
        return invalid(
            None, "We could not parse the JSON body of your request: it must be one JSON object.", "invalid_json"
        )
    if param is None:
        return invalid(None, "The request body must be a JSON object.", "invalid_type")
    if kind == "extra_forbidden":
        return invalid(param, f"Unrecognized request argument supplied: {param}", "unknown_parameter")
    if kind == "missing":
        return invalid(param, f"Missing required parameter: '{param}'.", "missing_required_parameter")
    if kind.endswith("_type") or kind in ("literal_error", "model_type"):
        return invalid(param, f"Invalid type for '{param}': {first['msg']}.", "invalid_type")
    return invalid(param, f"Invalid value for '{param}': {first['msg']}.")


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


class BodyLimit:
    """413 for a body over `limit` bytes, by its Content-Length or as it arrives. The body is
    read whole here (every route reads it whole anyway) and handed on in one message."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        too_large = error_response(
            APIError(413, f"The request body is larger than {self.limit} bytes.", code="request_too_large")
        )
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            await too_large(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away before its body arrived
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                await too_large(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        whole: Message | None = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay() -> Message:
            nonlocal whole
            if whole is not None:
                message, whole = whole, None
                return message
            return await receive()

        await self.app(scope, replay, send)


class KeyCheck:
    """With an API key, every /v1 route asks for `Authorization: Bearer KEY` (compared in
    constant time); /health stays open, as llama.cpp's server leaves it."""

    def __init__(self, app: ASGIApp, key: str | None) -> None:
        self.app = app
        self.key = key.encode() if key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.key is None or scope["type"] != "http" or not scope["path"].startswith("/v1"):
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
            message = (
                "Incorrect API key provided." if given else "You didn't provide an API key (Authorization: Bearer KEY)."
            )
            await error_response(APIError(401, message, code="invalid_api_key"))(scope, receive, send)
            return
        await self.app(scope, receive, send)


class ClientGone(Exception):
    pass


class Endpoints:
    """The routes' handlers over one served pair."""

    def __init__(
        self, served: Served, service: GenerationService, defaults: SpecConfig, log: Callable[[str], None]
    ) -> None:
        self.served = served
        self.defaults = defaults
        self.service = service
        self.log = log
        self.encoder = PromptEncoder(served.pipeline.tokenizer, served.speculator.target.max_length)
        self.vocab_size = len(served.pipeline.tokenizer)

    async def health(self, request: Request) -> Response:
        return JSONResponse(
            {
                "status": "stopping" if self.service.stopping else "ok",
                "model": self.served.name,
                "generating": self.service.busy,
                "waiting": self.service.waiting,
                "max_queue": self.service.max_queue,
                "requests": self.service.counts.as_dict(),
            }
        )

    async def models(self, request: Request) -> Response:
        return JSONResponse(ModelList(data=[self.served.model_card()]).model_dump())

    async def model(self, request: Request) -> Response:
        name = request.path_params["model"]
        if name != self.served.name:
            raise self._unknown_model(name)
        return JSONResponse(self.served.model_card().model_dump())

    def _unknown_model(self, name: str) -> APIError:
        return APIError(
            404,
            f"The model '{name}' does not exist: this server serves '{self.served.name}'.",
            param="model",
            code="model_not_found",
        )

    async def chat_completions(self, request: Request) -> Response:
        return await self._complete(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, chat=False)

    async def _complete(self, request: Request, chat: bool) -> Response:
        raw = await request.body()
        model = ChatCompletionRequest if chat else CompletionRequest
        try:
            body = model.model_validate_json(raw)
        except ValidationError as error:
            raise validation_error(error) from None
        problem = body.unsupported()
        if problem is not None:
            raise problem
        if body.model != self.served.name:
            raise self._unknown_model(body.model)
        prompt = body.prompt() if isinstance(body, ChatCompletionRequest) else body.prompt_of(self.vocab_size)
        try:
            ids = await run_in_threadpool(self.encoder.encode, prompt)
        except ContextOverflowError as error:
            raise invalid(
                "messages" if chat else "prompt",
                f"This model's maximum context length is {error.context} tokens, and the prompt is"
                f" {error.prompt_tokens} tokens long.",
                "context_length_exceeded",
            ) from None
        except PromptError as error:
            raise invalid("messages" if chat else "prompt", str(error), "invalid_prompt") from None
        try:
            sampling = body.sampling()
            spec = body.spec(len(ids), self.encoder.context, self.defaults, None if chat else COMPLETIONS_MAX_TOKENS)
        except ValueError as error:
            raise invalid(None, str(error)) from None

        loop = asyncio.get_running_loop()
        updates: asyncio.Queue[Update] = asyncio.Queue()

        def post(update: Update) -> None:  # from the worker thread
            try:
                loop.call_soon_threadsafe(updates.put_nowait, update)
            except RuntimeError:  # the server's loop has closed: nobody waits for this any more
                pass

        job = Job(ids, sampling, spec, post=post)
        try:
            self.service.submit(job)
        except QueueFull as full:
            raise APIError(
                503,
                f"The server is busy: {full.waiting} requests are waiting (one generation runs at a"
                " time). Retry later.",
                type="server_error",
                code="server_busy",
                headers={"Retry-After": str(full.retry_after)},
            ) from None
        except ShuttingDown:
            raise self._stopping() from None
        reply = Reply(chat, self.served.name)
        label = f"{request.method} {request.url.path}"
        gone = self._watch(request)
        try:
            first = await self._next(updates, gone)
            if isinstance(first, Failed):
                raise self._failure(first)
            if not body.stream:
                return await self._whole(job, updates, reply, body, len(ids), gone, label)
        except ClientGone:
            job.cancel()
            self.log(f"{label}: the client went away while waiting")
            return Response(status_code=499)
        finally:
            gone.cancel()  # from here a stream's disconnect is watched by the response itself
        return EventSourceResponse(self._stream(job, updates, reply, body, len(ids), label), sep="\n", ping=15)

    def _failure(self, failed: Failed) -> APIError:
        """A generation that could not run: the server stopping (503), or a fault of specgen's (500)."""
        return self._stopping() if failed.stopping else APIError(500, failed.message, type="server_error")

    def _stopping(self) -> APIError:
        return APIError(503, "The server is shutting down.", type="server_error", code="shutting_down")

    async def _next(self, updates: asyncio.Queue[Update], gone: asyncio.Future) -> Update:
        """The job's next update, unless the client goes away first (`gone`: see `_watch`)."""
        update = asyncio.ensure_future(updates.get())
        await asyncio.wait({update, gone}, return_when=asyncio.FIRST_COMPLETED)
        if update.done():
            return update.result()
        update.cancel()
        raise ClientGone()

    @staticmethod
    def _watch(request: Request) -> asyncio.Future:
        """A task that ends when the client disconnects (its body has been read whole, so the
        next message a request can receive is the disconnect)."""

        async def until_gone() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        return asyncio.ensure_future(until_gone())

    async def _whole(
        self,
        job: Job,
        updates: asyncio.Queue[Update],
        reply: Reply,
        body,
        prompt_tokens: int,
        gone: asyncio.Future,
        label: str,
    ) -> Response:
        try:
            while True:
                update = await self._next(updates, gone)
                if isinstance(update, Failed):
                    raise self._failure(update)
                if isinstance(update, Finished):
                    break
        except ClientGone:
            job.cancel()
            self.log(f"{label}: the client went away; its generation stopped")
            return Response(status_code=499)
        finally:
            job.cancel()  # a no-op once the generation ended
            gone.cancel()
        generation = update.generation
        self._log_done(label, update)
        if not generation.finished:
            raise self._stopping()
        specgen = figures(self.served, generation, job.sampling, job.spec, body.specgen.tokens)
        return JSONResponse(reply.whole(generation, usage(prompt_tokens, generation), specgen))

    async def _stream(
        self, job: Job, updates: asyncio.Queue[Update], reply: Reply, body, prompt_tokens: int, label: str
    ):
        with_tokens = body.specgen.tokens
        ended = False
        try:
            first = reply.first_chunk()
            if first is not None:
                yield _data(first)
            while True:
                update = await updates.get()
                if isinstance(update, Token):
                    if update.event.text or with_tokens:
                        yield _data(reply.token_chunk(update.event, with_tokens))
                elif isinstance(update, Finished):
                    self._log_done(label, update)
                    generation = update.generation
                    if not generation.finished:
                        yield _data(self._stopping().body())
                        break
                    specgen = figures(self.served, generation, job.sampling, job.spec, False)
                    yield _data(reply.finish_chunk(generation, specgen))
                    if body.include_usage:
                        yield _data(reply.usage_chunk(usage(prompt_tokens, generation)))
                    break
                elif isinstance(update, Failed):
                    error = self._failure(update)
                    yield _data(error.body())
                    break
            ended = True
            yield "[DONE]"
        finally:
            job.cancel()  # the client went away: the worker stops within one step
            if not ended:
                self.log(f"{label}: the client went away; its generation stopped")

    def _log_done(self, label: str, update: Finished) -> None:
        stats = update.generation.stats
        rate = stats.acceptance_rate
        acceptance = "" if rate is None else f", acceptance {100 * rate:.0f}%"
        speed = "" if stats.tokens_per_second is None else f", {stats.tokens_per_second:.1f} tok/s"
        self.log(
            f"{label}: {stats.new_tokens} tokens in {update.seconds:.2f} s{speed}{acceptance},"
            f" finished by {update.generation.finish_reason}"
        )


def _data(payload: dict) -> str:
    return json.dumps(payload, ensure_ascii=False)


def create_app(
    served: Served,
    service: GenerationService,
    defaults: SpecConfig = SpecConfig(k=AUTO_K),
    api_key: str | None = None,
    log: Callable[[str], None] = lambda message: None,
    max_body: int = MAX_BODY_BYTES,
) -> ASGIApp:
    """The ASGI app: `defaults` gives k and tree to requests that do not set them."""
    endpoints = Endpoints(served, service, defaults, log)

    async def api_error(request: Request, error: Exception) -> Response:
        assert isinstance(error, APIError)
        return error_response(error)

    async def http_error(request: Request, error: Exception) -> Response:
        assert isinstance(error, HTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
        message = {
            404: f"No route {request.url.path}: see GET /v1/models, POST /v1/chat/completions,"
            " POST /v1/completions, GET /health.",
            405: f"{request.method} is not allowed on {request.url.path}.",
        }.get(error.status_code, str(error.detail))
        return error_response(APIError(error.status_code, message, code=code))

    async def internal_error(request: Request, error: Exception) -> Response:
        log(f"{request.method} {request.url.path}: internal error: {type(error).__name__}: {error}")
        return error_response(APIError(500, f"Internal error in specgen: {type(error).__name__}.", type="server_error"))

    app = Starlette(
        routes=[
            Route("/health", endpoints.health, methods=["GET"]),
            Route("/v1/models", endpoints.models, methods=["GET"]),
            Route("/v1/models/{model:path}", endpoints.model, methods=["GET"]),
            Route("/v1/chat/completions", endpoints.chat_completions, methods=["POST"]),
            Route("/v1/completions", endpoints.completions, methods=["POST"]),
        ],
        exception_handlers={APIError: api_error, HTTPException: http_error, Exception: internal_error},
    )
    return KeyCheck(BodyLimit(app, max_body), api_key)
