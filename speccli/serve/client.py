"""The client `specgen generate --server URL` uses: one streamed request to a running
`specgen serve`, whose tokens and figures come back in the shape a local generation gives
them, so that the same renderer prints both (speccli.ui.plain.print_remote_generation).

A server that is busy (503, its queue full) is asked again after the Retry-After it gives;
one that cannot be reached or fails is a RuntimeFailure (exit 1); a request it refuses
(400, 401, 404, 413) a UsageError (exit 2) in the server's own words.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Callable, Generator, Iterator

from speccli.config import SamplingConfig, SpecConfig
from speccli.errors import RuntimeFailure, UsageError

SERVER_ENV = "SPECGEN_SERVER"
API_KEY_ENV = "SPECGEN_API_KEY"
CONNECT_SECONDS = 10.0
# How long a client waits in all for a busy server to take its request.
BUSY_PATIENCE_SECONDS = 300.0


def api_base(server: str) -> str:
    """The API's base URL from what the user gave: `host:port`, `http://host:port` or `.../v1`."""
    url = server.strip().rstrip("/")
    if not url:
        raise UsageError(
            "--server is empty", f"give the server's address, e.g. http://127.0.0.1:8000 (or unset {SERVER_ENV})"
        )
    if "://" not in url:
        url = "http://" + url
    if not url.startswith(("http://", "https://")):
        raise UsageError(f"--server must be an http:// or https:// address, got {server!r}")
    return url if url.endswith("/v1") else url + "/v1"


@dataclass(frozen=True)
class RemoteRequest:
    prompt: str
    chat: bool
    system: str | None
    sampling: SamplingConfig
    spec: SpecConfig
    with_tokens: bool

    def body(self, model: str) -> dict:
        body: dict = {
            "model": model,
            "stream": True,
            "max_tokens": self.spec.max_new_tokens,
            "temperature": self.sampling.temperature,
            "top_p": self.sampling.top_p,
            "top_k": self.sampling.top_k,
            "specgen": {"k": self.spec.k, "tree": self.spec.tree, "tokens": self.with_tokens},
        }
        if self.sampling.seed is not None:
            body["seed"] = self.sampling.seed
        if self.spec.stop_strings:
            body["stop"] = list(self.spec.stop_strings)
        if self.chat:
            messages = [{"role": "system", "content": self.system}] if self.system else []
            body["messages"] = [*messages, {"role": "user", "content": self.prompt}]
        else:
            body["prompt"] = self.prompt
        return body


@dataclass
class RemoteGeneration:
    """What came back: text pieces as they arrive (iterate), then the server's figures."""

    pieces: Generator[str, None, None]
    tokens: list[dict] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    figures: dict | None = None  # the `specgen` object of the last chunk; None if it never came

    @property
    def finished(self) -> bool:
        return self.figures is not None

    @property
    def finish_reason(self) -> str:
        return self.figures["finish_reason"] if self.figures is not None else "interrupted"

    def __iter__(self) -> Iterator[str]:
        return self.pieces


class ServerClient:
    def __init__(self, server: str, api_key: str | None, progress: Callable[[str], None]) -> None:
        import httpx

        self.base = api_base(server)
        self.progress = progress
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(headers=headers, timeout=httpx.Timeout(None, connect=CONNECT_SECONDS))

    def close(self) -> None:
        self._http.close()

    def served_model(self) -> str:
        """The name the server serves (GET /v1/models)."""
        response = self._call(lambda: self._http.get(self.base + "/models"))
        if response.status_code != 200:
            self._refused(response.status_code, response.read())
        try:
            return response.json()["data"][0]["id"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise RuntimeFailure(
                f"{self.base} did not answer GET /models as an OpenAI server does", "is it specgen serve?"
            ) from None

    def generate(self, request: RemoteRequest, model: str) -> RemoteGeneration:
        path = "/chat/completions" if request.chat else "/completions"
        remote = RemoteGeneration(_nothing())
        remote.pieces = self._stream(path, request.body(model), remote)
        return remote

    def _call(self, send):
        import httpx

        try:
            return send()
        except httpx.TransportError as error:
            raise RuntimeFailure(
                f"cannot reach specgen serve at {self.base}: {error or type(error).__name__}",
                f"start it with `specgen serve`, or point --server ({SERVER_ENV}) at it",
            ) from None

    def _stream(self, path: str, body: dict, remote: RemoteGeneration) -> Generator[str, None, None]:
        from httpx_sse import EventSource

        waited = 0.0
        while True:
            request = self._http.build_request(
                "POST", self.base + path, json=body, headers={"Accept": "text/event-stream"}
            )
            response = self._call(lambda: self._http.send(request, stream=True))
            if response.status_code == 503 and waited < BUSY_PATIENCE_SECONDS:
                content = response.read()
                response.close()
                if _error_code(content) == "server_busy":
                    pause = min(float(response.headers.get("Retry-After", "1") or 1), 30.0)
                    self.progress(f"the server is busy (its queue is full): asking again in {pause:.0f} s")
                    time.sleep(pause)
                    waited += pause
                    continue
                self._refused(503, content)
            break
        try:
            if response.status_code != 200:
                self._refused(response.status_code, response.read())
            for event in EventSource(response).iter_sse():
                if event.data == "[DONE]":
                    return
                chunk = json.loads(event.data)
                if "error" in chunk:
                    error = chunk["error"]
                    raise RuntimeFailure(f"the server ended the answer: {error.get('message')}", "see the server's log")
                remote.tokens.extend(chunk.get("specgen", {}).get("tokens", []))
                for choice in chunk.get("choices", []):
                    piece = choice["delta"].get("content") if "delta" in choice else choice.get("text")
                    if choice.get("finish_reason") is not None:
                        remote.figures = chunk.get("specgen")
                    if piece:
                        remote.text.append(piece)
                        yield piece
        finally:
            response.close()

    def _refused(self, status: int, content: bytes) -> None:
        message = _error_message(content) or f"HTTP {status}"
        if status == 401:
            raise UsageError(
                f"the server refused the key: {message}", f"give the server's key: --api-key or {API_KEY_ENV}"
            )
        if status == 404:
            raise UsageError(
                f"the server refused the request: {message}", "leave --target out to use the model it serves"
            )
        if 400 <= status < 500:
            raise UsageError(f"the server refused the request: {message}")
        raise RuntimeFailure(f"the server failed (HTTP {status}): {message}", "see the server's log")


def _nothing() -> Generator[str, None, None]:
    yield from ()


def _error_object(content: bytes) -> dict:
    try:
        error = json.loads(content).get("error")
    except (ValueError, AttributeError):
        return {}
    return error if isinstance(error, dict) else {}


def _error_message(content: bytes) -> str | None:
    return _error_object(content).get("message")


def _error_code(content: bytes) -> str | None:
    return _error_object(content).get("code")
