"""`specgen serve` as its clients see it: the real server on a free loopback port, small models
built here, driven by the official `openai` client and by raw HTTP."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch

from conftest import (
    ENDLESS_CONTEXT,
    char_tokenizer,
    default_sigint,
    isolated_env,
    never_ends,
    perturbed_copy,
    read_first,
    save_model_folder,
    tiny_llama,
)

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
MODEL = "tiny"
READY = re.compile(r"serving (\S+) at (http://\S+)/v1")
START_SECONDS = 180


class ServerProcess:
    """`specgen serve ... --port 0` in a child process; its stderr is read as it comes."""

    def __init__(self, args: list[str], home: Path, **env: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "speccli.cli", "serve", *args, "--port", "0"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=REPO,
            env=isolated_env(home, **env),
            preexec_fn=default_sigint,
        )
        self.lines: list[str] = []
        self.url: str | None = None
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._ready.wait(START_SECONDS) or self.url is None:
            self.process.kill()
            raise AssertionError("the server did not start:\n" + self.stderr)

    def _read(self) -> None:
        for raw in self.process.stderr:
            line = raw.decode(errors="replace")
            self.lines.append(line)
            found = READY.search(line)
            if found:
                self.url = found.group(2)
                self._ready.set()
        self._ready.set()

    @property
    def stderr(self) -> str:
        return "".join(self.lines)

    @property
    def base(self) -> str:
        return self.url + "/v1"

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def stop(self, timeout: float = 30) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
        code = self.process.wait(timeout)
        self._reader.join(5)
        return code


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    tokenizer = char_tokenizer()
    tokenizer.chat_template = TEMPLATE
    target = tiny_llama(len(tokenizer), seed=1, logit_scale=20.0, max_positions=4096)
    draft = perturbed_copy(target, noise=0.3, seed=11)
    endless = never_ends(tiny_llama(len(tokenizer), seed=1, logit_scale=20.0, max_positions=ENDLESS_CONTEXT))
    root = tmp_path_factory.mktemp("models")
    return {
        "tokenizer": tokenizer,
        "target_model": target,
        "target": str(save_model_folder(target, tokenizer, root / "target")),
        "draft": str(save_model_folder(draft, tokenizer, root / "draft")),
        "endless": str(save_model_folder(endless, tokenizer, root / "endless")),
    }


def model_args(folders) -> list[str]:
    return ["--target", folders["target"], "--draft", folders["draft"], "--device", "cpu", "--dtype", "float32"]


@pytest.fixture(scope="module")
def server(folders, tmp_path_factory):
    running = ServerProcess([*model_args(folders), "--model-name", MODEL], tmp_path_factory.mktemp("home"))
    yield running
    running.stop()


def endless_args(folders) -> list[str]:
    """The endless target alone (no draft), float32 on the CPU, served as MODEL."""
    return [
        "--target",
        folders["endless"],
        "--draft",
        "none",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--model-name",
        MODEL,
    ]


@pytest.fixture(scope="module")
def endless_server(folders, tmp_path_factory):
    """A target whose answers never end by themselves (one character a token), one waiting place."""
    running = ServerProcess(
        [
            *endless_args(folders),
            "--max-queue",
            "1",
            "--host",
            "0.0.0.0",
        ],
        tmp_path_factory.mktemp("home"),
    )
    running.url = running.url.replace("0.0.0.0", "127.0.0.1")
    yield running
    running.stop()


def client(server, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base, api_key=kwargs.pop("api_key", "none"), max_retries=0, **kwargs)


def reference(folders, ids: list[int], max_new: int) -> str:
    tokenizer, model = folders["tokenizer"], folders["target_model"]
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False)
    return tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)


def reference_text(folders, prompt: str, max_new: int) -> str:
    return reference(folders, folders["tokenizer"](prompt)["input_ids"], max_new)


def reference_chat(folders, messages: list[dict], max_new: int) -> str:
    ids = folders["tokenizer"].apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return reference(folders, list(ids["input_ids"] if hasattr(ids, "keys") else ids), max_new)


def specgen(*args: str, home: Path, stdin: bytes = b"", **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "speccli.cli", *args],
        input=stdin,
        capture_output=True,
        cwd=REPO,
        env=isolated_env(home, **env),
        timeout=300,
    )


def post(server, path: str, body, headers: dict | None = None) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(
        server.base + path, content=content, headers={"Content-Type": "application/json", **(headers or {})}, timeout=60
    )


# ---------------------------------------------------------------------------------------------
# Answers


def test_a_text_completion_is_the_targets_greedy_text(server, folders):
    answer = client(server).completions.create(model=MODEL, prompt="def fib(n):", max_tokens=24, temperature=0)
    assert answer.choices[0].text == reference_text(folders, "def fib(n):", 24)
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage.completion_tokens == 24
    assert answer.usage.prompt_tokens == len(folders["tokenizer"]("def fib(n):")["input_ids"])
    figures = answer.model_extra["specgen"]
    assert figures["drafter"] == "model" and figures["finish_reason"] == "length"
    assert figures["drafted"] >= figures["accepted"] >= 0
    assert figures["stats"]["new_tokens"] == 24
    assert set(figures) >= {"acceptance_rate", "tokens_per_step", "estimated_speedup", "settings"}


def test_a_streamed_chat_is_the_targets_greedy_answer(server, folders):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]
    stream = client(server).chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference_chat(folders, messages, 20)
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishing) == 1 and finishing[0].choices[0].finish_reason == "length"
    assert finishing[0].model_extra["specgen"]["stats"]["new_tokens"] == 20
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20


def test_the_stream_ends_with_done(server):
    with httpx.stream(
        "POST",
        server.base + "/completions",
        timeout=60,
        json={"model": MODEL, "prompt": "abc", "max_tokens": 4, "temperature": 0, "stream": True},
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert all(json.loads(line[6:])["object"] == "text_completion" for line in lines[:-1])


def test_a_chat_answer_whole_and_a_stop_string(server, folders):
    messages = [{"role": "user", "content": "Tell me."}]
    full = reference_chat(folders, messages, 30)
    stop = full[10:12]
    answer = client(server).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=30, temperature=0, stop=[stop]
    )
    assert answer.choices[0].message.content == full[: full.index(stop)]
    assert answer.choices[0].finish_reason == "stop"
    assert answer.model_extra["specgen"]["finish_reason"] == "stop_string"


def test_a_second_turn_reuses_the_cached_prefix(server, folders):
    openai_client = client(server)
    first = [{"role": "user", "content": "One question, and a long one at that."}]
    answer = openai_client.chat.completions.create(model=MODEL, messages=first, max_tokens=8, temperature=0)
    second = [
        *first,
        {"role": "assistant", "content": answer.choices[0].message.content},
        {"role": "user", "content": "And another."},
    ]
    again = openai_client.chat.completions.create(model=MODEL, messages=second, max_tokens=8, temperature=0)
    assert again.choices[0].message.content == reference_chat(folders, second, 8)
    assert again.usage.prompt_tokens_details.cached_tokens >= 30


def test_default_values_of_parameters_specgen_cannot_honour_pass(server, folders):
    answer = client(server).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "x"}],
        max_completion_tokens=5,
        temperature=0,
        n=1,
        presence_penalty=0,
        frequency_penalty=0,
        logprobs=False,
        response_format={"type": "text"},
        user="me",
        tool_choice="none",
        top_p=1,
        extra_body={"top_k": 0, "specgen": {"k": 2}},
    )
    assert answer.choices[0].message.content == reference_chat(folders, [{"role": "user", "content": "x"}], 5)
    assert answer.model_extra["specgen"]["settings"]["k"] == 2


def test_token_ids_as_the_prompt(server, folders):
    ids = folders["tokenizer"]("hello")["input_ids"]
    answer = client(server).completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0)
    assert answer.choices[0].text == reference(folders, ids, 10)


def test_models_and_health(server, folders):
    models = client(server).models.list()
    assert [m.id for m in models.data] == [MODEL]
    info = models.data[0].model_extra["specgen"]
    assert info["target"] == folders["target"] and info["draft"] == folders["draft"] and info["context"] == 4096
    assert client(server).models.retrieve(MODEL).id == MODEL
    health = server.health()
    assert health["status"] == "ok" and health["model"] == MODEL and health["waiting"] == 0


def test_four_concurrent_clients_each_get_their_solo_answer(server, folders):
    prompts = ["alpha", "bravo charlie", "delta: 1, 2", "echo(x)"]

    def ask(prompt: str) -> str:
        answer = client(server).completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
        return answer.choices[0].text

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, prompts))
    assert answers == [reference_text(folders, p, 24) for p in prompts]


# ---------------------------------------------------------------------------------------------
# What `generate` prints locally, through the server


def test_generate_through_the_server_prints_exactly_what_generate_prints(server, folders, tmp_path):
    for options in (
        ["def fib(n):", "-n", "24"],
        ["Tell me.", "--chat", "--system", "Be brief.", "-n", "20"],
        ["abcdef", "-n", "40", "--stop", "k'"],
        ["once upon", "-n", "24", "--temperature", "0.8", "--seed", "7", "--top-p", "0.9"],
    ):
        local = specgen("generate", *options, *model_args(folders), "-q", home=tmp_path)
        remote = specgen("generate", *options, "--server", server.url, "-q", home=tmp_path)
        assert local.returncode == remote.returncode == 0, (local.stderr, remote.stderr)
        assert remote.stdout == local.stdout and local.stdout, options
        assert remote.stderr == b""


def test_seeded_sampling_equals_generate_seed(server, folders, tmp_path):
    local = specgen(
        "generate",
        "seeded",
        "-n",
        "30",
        "--temperature",
        "1.0",
        "--seed",
        "3",
        *model_args(folders),
        "-q",
        home=tmp_path,
    )
    answer = client(server).completions.create(model=MODEL, prompt="seeded", max_tokens=30, temperature=1.0, seed=3)
    assert local.returncode == 0
    assert answer.choices[0].text == local.stdout.decode()


def test_generate_json_and_stats_through_the_server(server, folders, tmp_path):
    local = specgen("generate", "abc", "-n", "16", "--json", "--k", "3", *model_args(folders), "-q", home=tmp_path)
    remote = specgen(
        "generate", "abc", "-n", "16", "--json", "--k", "3", "--server", server.url, "--stats", home=tmp_path
    )
    assert local.returncode == remote.returncode == 0, remote.stderr
    mine, theirs = json.loads(local.stdout), json.loads(remote.stdout)
    assert list(theirs) == list(mine)
    for key in ("text", "token_ids", "finish_reason", "target", "draft", "settings"):
        assert theirs[key] == mine[key], key
    assert [t["text"] for t in theirs["tokens"]] == [t["text"] for t in mine["tokens"]]
    assert set(theirs["stats"]) == set(mine["stats"]) and theirs["stats"]["new_tokens"] == 16
    stderr = remote.stderr.decode()
    assert "acceptance" in stderr and "tok/s" in stderr and "target " in stderr


@pytest.mark.parametrize(
    "args, code, words",
    [
        (["--target", "another"], 2, "does not exist"),
        (["--draft", "ngram"], 2, "cannot apply with --server"),
        (["--device", "cpu"], 2, "cannot apply with --server"),
        (["--tp", "2"], 2, "--tp cannot apply with --server"),
        (["--temperature", "-1"], 2, "temperature"),
    ],
)
def test_generate_through_the_server_refuses_with_one_line(server, tmp_path, args, code, words):
    result = specgen("generate", "x", "--server", server.url, *args, home=tmp_path)
    assert result.returncode == code
    stderr = result.stderr.decode()
    assert words in stderr and "Traceback" not in stderr and result.stdout == b""


def test_generate_with_no_server_there_exits_1(tmp_path):
    result = specgen("generate", "x", home=tmp_path, SPECGEN_SERVER="http://127.0.0.1:9")
    assert result.returncode == 1
    assert "cannot reach specgen serve" in result.stderr.decode() and "Traceback" not in result.stderr.decode()


# ---------------------------------------------------------------------------------------------
# Bad input: its status and error object, and the server goes on serving

BIG = 5 << 20


@pytest.mark.parametrize(
    "path, body, status, param, code",
    [
        ("/chat/completions", b"{not json", 400, None, "invalid_json"),
        ("/chat/completions", b"", 400, None, "invalid_json"),
        ("/chat/completions", b"[1, 2]", 400, None, "invalid_type"),
        (
            "/chat/completions",
            {"messages": [{"role": "user", "content": "x"}]},
            400,
            "model",
            "missing_required_parameter",
        ),
        (
            "/chat/completions",
            {"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]},
            404,
            "model",
            "model_not_found",
        ),
        ("/chat/completions", {"model": MODEL, "messages": []}, 400, "messages", "invalid_value"),
        (
            "/chat/completions",
            {"model": MODEL, "messages": [{"role": "tool", "content": "x"}]},
            400,
            "messages.[0].role",
            "invalid_type",
        ),
        (
            "/chat/completions",
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            },
            400,
            "messages.[0].content.[0]",
            "unsupported_parameter",
        ),
        (
            "/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": 5}]},
            400,
            "messages.[0].content",
            "invalid_type",
        ),
        ("/completions", {"model": MODEL, "prompt": "x", "temperature": "0.5"}, 400, "temperature", "invalid_type"),
        ("/completions", {"model": MODEL, "prompt": "x", "temperature": 2.5}, 400, "temperature", "invalid_value"),
        ("/completions", b'{"model": "tiny", "prompt": "x", "temperature": NaN}', 400, "temperature", "invalid_value"),
        ("/completions", {"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p", "invalid_value"),
        ("/completions", {"model": MODEL, "prompt": "x", "top_k": -1}, 400, "top_k", "invalid_value"),
        ("/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
        ("/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1.5}, 400, "max_tokens", "invalid_type"),
        ("/completions", {"model": MODEL, "prompt": "x", "seed": "7"}, 400, "seed", "invalid_type"),
        ("/completions", {"model": MODEL, "prompt": "x", "seed": 1 << 64}, 400, "seed", "invalid_value"),
        ("/completions", {"model": MODEL, "prompt": "x", "n": 2}, 400, "n", "unsupported_value"),
        (
            "/completions",
            {"model": MODEL, "prompt": "x", "presence_penalty": 0.5},
            400,
            "presence_penalty",
            "unsupported_value",
        ),
        (
            "/completions",
            {"model": MODEL, "prompt": "x", "frequency_penalty": -1},
            400,
            "frequency_penalty",
            "unsupported_value",
        ),
        ("/completions", {"model": MODEL, "prompt": "x", "logprobs": 2}, 400, "logprobs", "unsupported_value"),
        ("/completions", {"model": MODEL, "prompt": "x", "echo": True}, 400, "echo", "unsupported_value"),
        (
            "/completions",
            {"model": MODEL, "prompt": "x", "logit_bias": {"5": 10}},
            400,
            "logit_bias",
            "unsupported_value",
        ),
        (
            "/completions",
            {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}},
            400,
            "stream_options",
            "invalid_value",
        ),
        ("/completions", {"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt", "unsupported_value"),
        ("/completions", {"model": MODEL, "prompt": ""}, 400, "prompt", "invalid_value"),
        ("/completions", {"model": MODEL, "prompt": [1, 99999]}, 400, "prompt", "invalid_value"),
        ("/completions", {"model": MODEL, "prompt": "x" * 5000}, 400, "prompt", "context_length_exceeded"),
        (
            "/completions",
            {"model": MODEL, "prompt": "x", "stop": ["a", "b", "c", "d", "e"]},
            400,
            "stop",
            "invalid_value",
        ),
        ("/completions", {"model": MODEL, "prompt": "x", "stop": ""}, 400, "stop", "invalid_value"),
        ("/completions", {"model": MODEL, "prompt": "x", "specgen": {"k": 0}}, 400, "specgen.k", "invalid_value"),
        ("/completions", {"model": MODEL, "prompt": "x", "foo": 1}, 400, "foo", "unknown_parameter"),
        (
            "/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": True},
            400,
            "logprobs",
            "unsupported_value",
        ),
        (
            "/chat/completions",
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "function", "function": {"name": "f"}}],
            },
            400,
            "tools",
            "unsupported_parameter",
        ),
        (
            "/chat/completions",
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "x"}],
                "response_format": {"type": "json_object"},
            },
            400,
            "response_format",
            "unsupported_value",
        ),
        (
            "/chat/completions",
            b'{"model": "tiny", "messages": [{"role": "user", "content": "' + b"x" * BIG + b'"}]}',
            413,
            None,
            "request_too_large",
        ),
    ],
)
def test_bad_requests_get_their_status_and_an_error_object(server, path, body, status, param, code):
    response = post(server, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["code"] == code and error["message"]
    assert error["type"] == "invalid_request_error"
    assert "Traceback" not in response.text


def test_routes_and_methods_that_do_not_exist(server):
    missing = httpx.get(server.base + "/engines", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    wrong = httpx.get(server.base + "/chat/completions", timeout=10)
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "method_not_allowed"
    assert httpx.get(server.base + "/models/gpt-4o", timeout=10).status_code == 404


def test_the_openai_client_raises_its_own_errors(server):
    with pytest.raises(openai.NotFoundError):
        client(server).completions.create(model="gpt-4o", prompt="x")
    with pytest.raises(openai.BadRequestError) as raised:
        client(server).completions.create(model=MODEL, prompt="x", n=3)
    assert raised.value.code == "unsupported_value" and raised.value.param == "n"


def test_after_every_bad_request_the_server_still_serves(server, folders):
    for body in (b"{", b"[]", b'{"model": 1}', json.dumps({"model": MODEL, "prompt": "x", "top_p": 7})):
        assert post(server, "/completions", body).status_code == 400
    answer = client(server).completions.create(model=MODEL, prompt="still", max_tokens=6, temperature=0)
    assert answer.choices[0].text == reference_text(folders, "still", 6)
    assert server.health()["requests"]["failed"] == 0
    assert "Traceback" not in server.stderr


def test_a_port_in_use_is_refused_before_loading(server, folders, tmp_path):
    port = server.url.rsplit(":", 1)[1]
    result = subprocess.run(
        [sys.executable, "-m", "speccli.cli", "serve", *model_args(folders), "--port", port],
        capture_output=True,
        cwd=REPO,
        env=isolated_env(tmp_path),
        timeout=120,
    )
    assert result.returncode == 2
    stderr = result.stderr.decode()
    assert f"cannot listen on 127.0.0.1:{port}" in stderr and "loading" not in stderr and "Traceback" not in stderr


# ---------------------------------------------------------------------------------------------
# One generation at a time: disconnects, a full queue, keys, stopping


def wait_for(condition, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_dropped_stream_ends_its_generation_and_the_next_is_answered(endless_server):
    before = endless_server.health()["requests"]
    with httpx.stream(
        "POST",
        endless_server.base + "/completions",
        timeout=60,
        json={"model": MODEL, "prompt": "go", "max_tokens": 100000, "temperature": 0, "stream": True},
    ) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen >= 5:
                break
    # The client went away after 5 tokens: the server's own count says the generation stopped.
    wait_for(lambda: endless_server.health()["requests"]["cancelled"] == before["cancelled"] + 1)
    after = endless_server.health()
    assert not after["generating"]
    assert 5 <= after["requests"]["tokens"] - before["tokens"] < 5000
    answer = client(endless_server).completions.create(model=MODEL, prompt="next", max_tokens=5, temperature=0)
    assert len(answer.choices[0].text) == 5


def test_a_client_that_gives_up_on_a_whole_answer_stops_its_generation(endless_server):
    before = endless_server.health()["requests"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            endless_server.base + "/completions",
            timeout=httpx.Timeout(60, read=1.0),
            json={"model": MODEL, "prompt": "go", "max_tokens": 100000, "temperature": 0},
        )
    wait_for(lambda: endless_server.health()["requests"]["cancelled"] == before["cancelled"] + 1)
    assert not endless_server.health()["generating"]
    assert endless_server.health()["requests"]["tokens"] - before["tokens"] < 50000


def test_past_max_queue_a_request_gets_503_with_retry_after(endless_server):
    running = httpx.stream(
        "POST",
        endless_server.base + "/completions",
        timeout=60,
        json={"model": MODEL, "prompt": "long", "max_tokens": 100000, "temperature": 0, "stream": True},
    )
    response = running.__enter__()
    try:
        lines = response.iter_lines()  # kept: a line iterator that is dropped closes the connection
        next(lines)
        waiting: dict = {}
        queued = threading.Thread(
            target=lambda: waiting.update(
                answer=post(
                    endless_server,
                    "/completions",
                    {"model": MODEL, "prompt": "queued", "max_tokens": 3, "temperature": 0},
                )
            )
        )
        queued.start()
        wait_for(lambda: endless_server.health()["waiting"] == 1)
        refused = post(endless_server, "/completions", {"model": MODEL, "prompt": "x", "max_tokens": 3})
        assert refused.status_code == 503
        assert int(refused.headers["Retry-After"]) >= 1
        assert refused.json()["error"]["code"] == "server_busy"
    finally:
        running.__exit__(None, None, None)
    queued.join(60)
    assert waiting["answer"].status_code == 200 and len(waiting["answer"].json()["choices"][0]["text"]) == 3


def test_a_non_loopback_address_without_a_key_is_warned_about(endless_server):
    assert "without --api-key" in endless_server.stderr


def test_an_api_key_is_asked_for_on_v1_only(folders, tmp_path):
    running = ServerProcess(
        [*model_args(folders), "--model-name", MODEL, "--draft", "ngram"], tmp_path, SPECGEN_API_KEY="s3cret"
    )
    try:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            refused = post(running, "/completions", body, headers)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(running.base + "/models", timeout=10).status_code == 401
        assert post(running, "/completions", body, {"Authorization": "Bearer s3cret"}).status_code == 200
        assert client(running, api_key="s3cret").models.list().data[0].id == MODEL
        assert httpx.get(running.url + "/health", timeout=10).status_code == 200
        result = specgen("generate", "x", "-n", "3", "--server", running.url, home=tmp_path)
        assert result.returncode == 2 and "--api-key" in result.stderr.decode()
        result = specgen("generate", "x", "-n", "3", "--server", running.url, home=tmp_path, SPECGEN_API_KEY="s3cret")
        assert result.returncode == 0 and len(result.stdout.decode()) > 0
    finally:
        assert running.stop() == 0


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_ends_the_running_generation_and_exits_cleanly(folders, tmp_path, stop):
    running = ServerProcess(endless_args(folders), tmp_path)
    with httpx.stream(
        "POST",
        running.base + "/completions",
        timeout=60,
        json={"model": MODEL, "prompt": "go", "max_tokens": 100000, "temperature": 0, "stream": True},
    ) as r:
        lines = r.iter_lines()
        next(lines)
        running.process.send_signal(stop)
        started = time.monotonic()
        rest = list(lines)  # the stream ends: the generation stopped
    code = running.process.wait(30)
    assert code == 0
    assert time.monotonic() - started < 15
    assert len(rest) < 100000
    running._reader.join(5)
    assert "stopped" in running.stderr and "Traceback" not in running.stderr


def test_ctrl_c_on_generate_server_stops_the_servers_generation(endless_server, tmp_path):
    before = endless_server.health()["requests"]["cancelled"]
    process = subprocess.Popen(
        [sys.executable, "-m", "speccli.cli", "generate", "hello", "-n", "100000", "--server", endless_server.url],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO,
        env=isolated_env(tmp_path),
        bufsize=0,
        preexec_fn=default_sigint,
    )
    first = read_first(process.stdout, 8)
    process.send_signal(signal.SIGINT)
    rest, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr.decode()
    assert len(first) == 8 and b"interrupted" in stderr and b"Traceback" not in stderr
    wait_for(lambda: endless_server.health()["requests"]["cancelled"] == before + 1)
    assert not endless_server.health()["generating"]
