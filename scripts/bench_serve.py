"""What `specgen serve` saves a shell loop, and what it costs per request.

    python scripts/bench_serve.py --requests 10 --max-new-tokens 32 --json-out serve.json

One machine, one run, greedy, the default pair unless --target/--draft say otherwise:

  oneshot   `specgen generate PROMPT --json` as a new process per request: the load every time
  client    `specgen generate PROMPT --json --server URL` as a new process per request, against
            one `specgen serve` started once (its start is timed too)
  http      the same requests streamed over HTTP from this process (one httpx client, its
            connection kept, as an editor's or an agent's): the server's own
            overhead per request is the wall time from sending the request to the stream's
            [DONE] less the engine's time (the generation's total_seconds); the first chunk's
            lag is the time to the first content chunk less the engine's time to its first
            token, set against one step of the engine (its decode time per step)

Every request's text is checked equal across the three (greedy: the target's own text). One
warm-up request goes to the server before timing (its first generation sets up the loop).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from speccli.models.kernels.cpu import cpu_name  # noqa: E402

READY = re.compile(r"serving (\S+) at (http://\S+)/v1")


def prompts(count: int) -> list[str]:
    rows = [json.loads(line) for line in (REPO / "scripts/prompts/default.jsonl").read_text().splitlines() if line]
    texts = [row["prompt"] for row in rows if "prompt" in row]
    return [texts[i % len(texts)] for i in range(count)]


def specgen(*args: str) -> tuple[float, dict]:
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "speccli.cli", *args], capture_output=True, cwd=REPO, timeout=1800)
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"specgen {' '.join(args[:3])} ... exited {result.returncode}:\n{result.stderr.decode()}")
    return seconds, json.loads(result.stdout)


class Server:
    def __init__(self, model_args: list[str]) -> None:
        started = time.perf_counter()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "speccli.cli", "serve", *model_args, "--port", "0"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            cwd=REPO,
        )
        self.url = None
        for raw in self.process.stderr:
            line = raw.decode(errors="replace")
            print(line, end="", file=sys.stderr)
            found = READY.search(line)
            if found:
                self.url = found.group(2)
                break
        if self.url is None:
            raise SystemExit("the server did not start")
        self.start_seconds = time.perf_counter() - started
        threading.Thread(target=lambda: [None for _ in self.process.stderr], daemon=True).start()

    def stop(self) -> int:
        self.process.send_signal(signal.SIGINT)
        return self.process.wait(60)


def streamed(http: httpx.Client, url: str, model: str, prompt: str, max_new: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_new, "temperature": 0, "stream": True}
    text, first, figures = [], None, None
    started = time.perf_counter()
    with http.stream("POST", url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk["choices"]:
                if choice["text"]:
                    if first is None:
                        first = time.perf_counter() - started
                    text.append(choice["text"])
                if choice["finish_reason"] is not None:
                    figures = chunk["specgen"]
    wall = time.perf_counter() - started
    stats = figures["stats"]
    step = (stats["draft_seconds"] + stats["verify_seconds"]) / max(1, stats["steps"])
    return {
        "text": "".join(text),
        "wall_s": wall,
        "engine_s": stats["total_seconds"],
        "overhead_ms": 1000 * (wall - stats["total_seconds"]),
        "first_chunk_s": first,
        "engine_first_token_s": stats["time_to_first_token_seconds"],
        "first_chunk_lag_ms": None if first is None else 1000 * (first - stats["time_to_first_token_seconds"]),
        "step_ms": 1000 * step,
        "new_tokens": stats["new_tokens"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--target", default=None)
    parser.add_argument("--draft", default=None)
    parser.add_argument("--extra", default="", help="More options for both generate and serve, space-separated.")
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args()

    model_args = [
        *(["--target", args.target] if args.target else []),
        *(["--draft", args.draft] if args.draft else []),
        *args.extra.split(),
    ]
    texts = prompts(args.requests)
    n = str(args.max_new_tokens)
    print(f"CPU: {cpu_name()}; {args.requests} requests of {n} tokens, greedy", file=sys.stderr)

    oneshot = []
    for i, prompt in enumerate(texts):
        seconds, record = specgen("generate", "-n", n, "--json", "-q", *model_args, "--", prompt)
        oneshot.append({"wall_s": seconds, "engine_s": record["stats"]["total_seconds"], "text": record["text"]})
        print(f"oneshot {i + 1}/{len(texts)}: {seconds:.2f} s", file=sys.stderr)

    server = Server(model_args)
    try:
        http_client = httpx.Client(timeout=None)  # one client, its connection kept, as an editor's or agent's
        model = http_client.get(server.url + "/v1/models").json()["data"][0]["id"]
        streamed(http_client, server.url, model, "warm-up", 4)
        client, http = [], []
        for i, prompt in enumerate(texts):
            seconds, record = specgen("generate", "-n", n, "--json", "-q", "--server", server.url, "--", prompt)
            client.append({"wall_s": seconds, "engine_s": record["stats"]["total_seconds"], "text": record["text"]})
            http.append(streamed(http_client, server.url, model, prompt, args.max_new_tokens))
            print(
                f"client {i + 1}/{len(texts)}: {seconds:.2f} s; http overhead {http[-1]['overhead_ms']:.1f} ms",
                file=sys.stderr,
            )
    finally:
        stopped = server.stop()

    mismatches = [i for i in range(len(texts)) if not oneshot[i]["text"] == client[i]["text"] == http[i]["text"]]
    total = {name: sum(r["wall_s"] for r in rows) for name, rows in (("oneshot", oneshot), ("client", client))}
    lags = [r["first_chunk_lag_ms"] for r in http if r["first_chunk_lag_ms"] is not None]
    summary = {
        "cpu": cpu_name(),
        "python": platform.python_version(),
        "requests": len(texts),
        "max_new_tokens": args.max_new_tokens,
        "model_args": model_args,
        "server_start_s": round(server.start_seconds, 2),
        "server_exit_code": stopped,
        "oneshot_total_s": round(total["oneshot"], 2),
        "client_total_s": round(total["client"], 2),
        "client_total_with_start_s": round(total["client"] + server.start_seconds, 2),
        "oneshot_over_client": round(total["oneshot"] / total["client"], 2),
        "oneshot_median_s": round(statistics.median(r["wall_s"] for r in oneshot), 3),
        "client_median_s": round(statistics.median(r["wall_s"] for r in client), 3),
        "client_overhead_median_ms": round(1000 * statistics.median(r["wall_s"] - r["engine_s"] for r in client), 1),
        "http_overhead_median_ms": round(statistics.median(r["overhead_ms"] for r in http), 1),
        "http_overhead_max_ms": round(max(r["overhead_ms"] for r in http), 1),
        "first_chunk_lag_median_ms": round(statistics.median(lags), 1) if lags else None,
        "first_chunk_lag_max_ms": round(max(lags), 1) if lags else None,
        "step_median_ms": round(statistics.median(r["step_ms"] for r in http), 1),
        "texts_equal": not mismatches,
        "mismatched_requests": mismatches,
    }
    print(json.dumps(summary, indent=2))
    if args.json_out:
        args.json_out.write_text(
            json.dumps(
                {"summary": summary, "oneshot": oneshot, "client": client, "http": http}, indent=2, ensure_ascii=False
            )
        )
    return 0 if not mismatches else 1


if __name__ == "__main__":
    raise SystemExit(main())
