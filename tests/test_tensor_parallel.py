"""`--tp 2` on the CPU (gloo): two ranks, the target split between them by transformers'
tensor-parallel plan, rank 0 running the command and the other rank its passes. The tokens
are the one-process run's; a rank that dies ends the run in seconds with one line."""

from __future__ import annotations

import json
import re
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import perturbed_copy, save_model_folder, tiny_llama
from test_chat import endless_folders  # noqa: F401 - a fixture: a chat pair that never ends an answer

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("tp")
    target = tiny_llama(len(tokenizer), seed=1, logit_scale=10.0, max_positions=4096)
    return (
        save_model_folder(target, tokenizer, root / "target"),
        save_model_folder(perturbed_copy(target, noise=0.3, seed=2), tokenizer, root / "draft"),
    )


def specgen(cache: Path, *args: str, **popen) -> subprocess.CompletedProcess | subprocess.Popen:
    command = [sys.executable, "-m", "speccli.cli", *args]
    env = {**os.environ, "PYTHONPATH": str(REPO), "SPECGEN_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    if popen:
        return subprocess.Popen(command, cwd=REPO, env=env, **popen)
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def tokens(cache: Path, folders, *args: str) -> tuple[list[int], str]:
    target, draft = folders
    result = specgen(
        cache,
        "generate",
        "hello hello",
        "--target",
        str(target),
        "--dtype",
        "float32",
        "-n",
        "24",
        "--json",
        "-q",
        *[str(draft) if a == "DRAFT" else a for a in args],
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    return out["token_ids"], out["settings"]["backend"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "method",
    [
        ("--draft", "DRAFT", "--k", "4"),
        ("--draft", "ngram"),
        ("--draft", "DRAFT", "--k", "3", "--tree"),
        ("--draft", "DRAFT", "--temperature", "1", "--seed", "7"),
    ],
    ids=["model-draft", "ngram", "tree", "seeded-sampling"],
)
def test_two_ranks_give_the_one_process_tokens(tmp_path, folders, method):
    alone, backend = tokens(tmp_path, folders, *method)
    split, split_backend = tokens(tmp_path, folders, *method, "--tp", "2")
    assert split == alone and len(split) == 24
    assert (backend, split_backend) == ("dynamic-cache", "dynamic-cache+tp2")


@pytest.mark.slow
def test_a_dead_rank_ends_the_run_with_one_line(tmp_path, folders):
    target, draft = folders
    run = specgen(
        tmp_path,
        "generate",
        "hello",
        "--target",
        str(target),
        "--draft",
        str(draft),
        "--dtype",
        "float32",
        "-n",
        "3000",
        "--k",
        "2",
        "-q",
        "--tp",
        "2",
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    log = tmp_path / "logs" / "rank-1.log"
    try:
        deadline = time.monotonic() + 120
        while "pid" not in (log.read_text() if log.is_file() else ""):
            assert time.monotonic() < deadline and run.poll() is None, "rank 1 never started"
            time.sleep(0.2)
        assert run.stdout.read(1)  # rank 0 is generating
        pid = int(log.read_text().split("(pid ")[1].split(")")[0])
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        code = run.wait(timeout=60)
        assert time.monotonic() - killed < 30
    finally:
        if run.poll() is None:
            run.kill()
    stderr = run.stderr.read().decode()
    assert code == 1
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert lines[-1].startswith(
        "error: rank 1 of the tensor-parallel run was killed by signal 9; the other ranks were stopped"
    ), stderr
    assert "Traceback" not in stderr


def test_tp_refuses_what_transformers_plan_cannot_split(tmp_path, folders):
    target, _ = folders
    result = specgen(
        tmp_path, "generate", "hi", "--target", str(target), "--draft", "none", "--quant", "4bit", "--tp", "2", "-q"
    )
    assert result.returncode == 2
    assert "--tp 2 splits unquantized weights; --quant 4bit is not split by transformers' plan" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_chat_over_two_ranks_in_a_terminal(endless_folders, tmp_path):
    """Rank 0 owns the terminal: colours, /stats, a Ctrl-C that stops the answer and keeps the
    session, and Ctrl-D that ends every process."""
    pexpect = pytest.importorskip("pexpect")
    from conftest import default_sigint
    from test_chat import chat_argv, child_env

    argv = chat_argv(endless_folders, 40) + ["--k", "4", "--tp", "2"]
    env = child_env(tmp_path)
    child = pexpect.spawn(
        argv[0],
        argv[1:],
        cwd=str(REPO),
        env=env,
        encoding="utf-8",
        timeout=120,
        dimensions=(50, 200),
        preexec_fn=default_sigint,
    )
    log = Path(env["SPECGEN_CACHE"]) / "logs" / "rank-1.log"
    try:
        child.expect_exact(">>>")
        child.send("hello there\r")
        child.expect(r"\d+ tokens \| [\d.]+ tok/s \| acceptance")
        assert re.search(r"\x1b\[(32|33|36)m", child.before), child.before
        child.expect_exact(">>>")
        child.send("/stats\r")
        child.expect_exact("session: 1 answer, ")
        child.expect_exact(">>>")
        child.send("/set max_tokens 100000\r")
        child.expect_exact("max_tokens = 100000")
        child.expect_exact(">>>")
        child.send("tell me everything\r")
        for _ in range(5):
            child.expect(r"\x1b\[(32|33|36)m")  # streaming
        child.sendintr()
        child.expect(r"interrupted \| \d+ tokens")
        child.expect_exact(">>>")
        child.send("/set max_tokens 20\r")
        child.expect_exact("max_tokens = 20")
        child.expect_exact(">>>")
        child.send("and again\r")  # the session, and rank 1, go on
        child.expect(r"\d+ tokens \| [\d.]+ tok/s \| acceptance")
        child.expect_exact(">>>")
        child.sendeof()
        child.expect_exact("session: 3 answers (1 interrupted)")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0, child.before
    follower = int(log.read_text().split("(pid ")[1].split(")")[0])
    assert not Path(f"/proc/{follower}").exists()  # no process left behind


@pytest.mark.slow
def test_bench_over_two_ranks_writes_the_same_columns(tmp_path, folders):
    target, draft = folders
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello hello\nabc abc abc\n")

    def report(*extra: str) -> dict:
        result = specgen(
            tmp_path,
            "bench",
            str(prompts),
            "--target",
            str(target),
            "--draft",
            str(draft),
            "--dtype",
            "float32",
            "-n",
            "12",
            "--k",
            "2",
            "-q",
            "--format",
            "json",
            *extra,
        )
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    alone, split = report(), report("--tp", "2")
    assert [sorted(row) for row in split["rows"]] == [sorted(row) for row in alone["rows"]]
    assert len(split["rows"]) == len(alone["rows"]) > 0


def test_each_rank_takes_its_local_gpu_unless_told_the_cpu(monkeypatch):
    import torch

    from speccli.backends.distributed import Rank, device_for

    rank = Rank(index=3, size=4, local=1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert device_for(rank) == torch.device("cuda", 1) and device_for(rank, "cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_for(rank) == torch.device("cpu")


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["eagle3", "eagle"])
def test_published_heads_over_two_ranks_give_the_one_process_tokens(tmp_path, tokenizer, layout):
    """A head embeds its tokens with the target's embedding (and EAGLE-1/2 scores them with its
    output rows), which the split target holds in shards: rank 0 gets them whole, gathered on
    every rank, and never calls the split modules alone (that would wait forever)."""
    from test_published_heads import eagle3_folder, eagle_folder

    target = tiny_llama(len(tokenizer), seed=3, layers=8, logit_scale=4.0, max_positions=4096)
    folder = save_model_folder(target, tokenizer, tmp_path / "target")
    head = (eagle3_folder if layout == "eagle3" else eagle_folder)(tmp_path / "head", target)
    alone, _ = tokens(tmp_path, (folder, None), "--draft", f"{layout}:{head}", "--k", "3")
    split, backend = tokens(tmp_path, (folder, None), "--draft", f"{layout}:{head}", "--k", "3", "--tp", "2")
    assert split == alone and len(split) == 24 and backend == "dynamic-cache+tp2"


def test_rank0_says_nothing_when_a_peer_went_away_and_the_launcher_names_it(monkeypatch, capsys):
    """Under load rank 0 may see a dead peer (its collective fails) before the launcher does:
    it exits EXIT_RANK_LOST without a line, and the one line names the rank that died."""
    from types import SimpleNamespace

    from speccli.backends import distributed
    from speccli.backends.distributed import EXIT_RANK_LOST

    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:32667.")

    def share(message):
        raise gloo

    monkeypatch.setattr(distributed, "share", share)
    leader = distributed.LeaderLM(SimpleNamespace(forward=lambda ids: None))
    with pytest.raises(SystemExit) as lost:
        leader.forward([1, 2])
    assert lost.value.code == EXIT_RANK_LOST
    monkeypatch.setattr(distributed, "share", lambda message: (_ for _ in ()).throw(RuntimeError("shape mismatch")))
    with pytest.raises(RuntimeError, match="shape mismatch"):  # anything else is rank 0's own error
        leader.forward([1, 2])
    failures = {0: SimpleNamespace(exitcode=EXIT_RANK_LOST, timestamp=2), 1: SimpleNamespace(exitcode=-9, timestamp=5)}
    assert distributed._exit_code(failures) == 1
    assert capsys.readouterr().err.startswith("error: rank 1 of the tensor-parallel run was killed by signal 9;")
    assert distributed._exit_code({0: SimpleNamespace(exitcode=2, timestamp=1)}) == 2  # rank 0's own, said by it
    assert distributed._exit_code({0: SimpleNamespace(exitcode=-6, timestamp=1)}) == 1
    assert capsys.readouterr().err == (  # rank 0 writes to the terminal: it has no log to name
        "error: rank 0 of the tensor-parallel run was killed by signal 6; the other ranks were stopped\n"
    )
