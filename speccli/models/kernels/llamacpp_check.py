"""Whether llama.cpp's repacked-weight kernels run on this CPU, tried in a child process.

llama.cpp repacks a model's weights at load for kernels made for the CPU at hand ("extra
buffer types"; on Intel Xeons with AMX, AMX tile kernels). Those can die of SIGILL where the
build found a feature its kernels then cannot use: llama-cpp-python 0.3.36, built from source
on a Xeon VM with AMX, dies at `tilezero` in ggml_backend_amx_mul_mat on every pass over
more than one token, while AMX itself runs there (ggml-org/llama.cpp#28756 reports the same
crash elsewhere). A signal kills the process before Python can do anything about it, so where
the build reports AMX, a child process first loads the model with those kernels and runs passes
over 1, 4 and 32 tokens, once per model file, llama.cpp build and CPU (the verdict is cached). If
the child dies, specgen loads the model without extra buffer types: llama.cpp's generic kernels,
slower and correct.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

CHECK_TIMEOUT_SECONDS = 900  # a large model's load with repacking takes minutes
TRIAL_PASSES = (1, 4, 32)
# What ggml prints in its system info when the build holds AMX kernels.
AMX_MARK = "AMX_INT8 = 1"

_CHECKS: dict[str, "KernelCheck"] = {}  # this process's verdicts, by key


@dataclass(frozen=True)
class KernelCheck:
    extra_buffers: bool  # whether loading with llama.cpp's extra buffer types is safe
    reason: str  # why not, in a few words ("" when safe)


def build_has_amx() -> bool:
    import llama_cpp

    return AMX_MARK in llama_cpp.llama_print_system_info().decode("utf-8", "replace")


def _library_identity() -> dict[str, object]:
    import llama_cpp

    folder = Path(llama_cpp.__file__).parent / "lib"
    libraries = sorted(folder.glob("*.so*")) + sorted(folder.glob("*.dylib")) + sorted(folder.glob("*.dll"))
    return {
        "llama_cpp": getattr(llama_cpp, "__version__", "unknown"),
        "libraries": [(p.name, p.stat().st_size, int(p.stat().st_mtime)) for p in libraries],
    }


def check_key(model_path: Path) -> str:
    from speccli.models.kernels.cpu import cpu_name
    from speccli.models.names.offline import identity_digest

    stat = model_path.stat()
    identity = {
        "model": [str(model_path.resolve()), stat.st_size, int(stat.st_mtime)],
        "cpu": cpu_name(),
        **_library_identity(),
    }
    return identity_digest(identity)


def _verdicts_path(cache_dir: Path | None) -> Path:
    from speccli.models.names import offline

    root = Path(cache_dir) if cache_dir is not None else offline.default_cache_dir()
    return root / "llama-cpp-checks.json"


def _read_cached(path: Path, key: str) -> KernelCheck | None:
    try:
        entry = json.loads(path.read_text())[key]
        return KernelCheck(bool(entry["extra_buffers"]), str(entry["reason"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_cached(path: Path, key: str, verdict: KernelCheck) -> None:
    from speccli.models.names import offline

    data = offline.read_json_object(path)
    data[key] = {"extra_buffers": verdict.extra_buffers, "reason": verdict.reason}
    offline.write_json(path, data)  # a read-only cache costs a check next time


def run_trial(model_path: Path) -> subprocess.CompletedProcess:
    """The child: load with extra buffer types and run the trial passes (see `_trial`)."""
    return subprocess.run(
        [sys.executable, "-m", "speccli.models.kernels.llamacpp_check", str(model_path)],
        capture_output=True,
        text=True,
        timeout=CHECK_TIMEOUT_SECONDS,
    )


def verdict_of(result: subprocess.CompletedProcess) -> tuple[KernelCheck, bool]:
    """The verdict from the child's exit, and whether it is worth caching: death by a signal
    condemns the kernels; any other failure (the file does not load, say) is not theirs, and the
    load itself will report it."""
    if result.returncode == 0:
        return KernelCheck(True, ""), True
    if result.returncode < 0:
        try:
            name = signal.Signals(-result.returncode).name
        except ValueError:
            name = f"signal {-result.returncode}"
        return KernelCheck(False, f"its repacked-weight (AMX) kernels die of {name} on this CPU"), True
    return KernelCheck(True, ""), False


def extra_buffers_verdict(
    model_path: Path | str,
    cache_dir: Path | None = None,
    say: Callable[[str], None] | None = None,
    trial: Callable[[Path], subprocess.CompletedProcess] = run_trial,
) -> KernelCheck:
    """Whether `model_path` may load with llama.cpp's extra buffer types here: yes without a
    trial where the build holds no AMX kernels; else the cached verdict, or a trial now."""
    model_path = Path(model_path)
    if not model_path.is_file() or not build_has_amx():
        return KernelCheck(True, "")  # no file: nothing to try; llama.cpp's own load says what is wrong
    key = check_key(model_path)
    if key in _CHECKS:
        return _CHECKS[key]
    path = _verdicts_path(cache_dir)
    verdict = _read_cached(path, key)
    if verdict is None:
        if say is not None:
            say(f"checking llama.cpp's AMX kernels on {model_path.name} in a child process (once per model and build)")
        try:
            verdict, keep = verdict_of(trial(model_path))
        except subprocess.TimeoutExpired:
            verdict, keep = KernelCheck(False, f"its trial did not finish in {CHECK_TIMEOUT_SECONDS} s"), False
        if keep:
            _write_cached(path, key, verdict)
    if not verdict.extra_buffers and say is not None:
        say(f"llama.cpp: {verdict.reason}; loading {model_path.name} without them (generic kernels)")
    _CHECKS[key] = verdict
    return verdict


def _trial(model_path: str) -> None:
    from speccli.autok.costs import filler_ids
    from speccli.backends.llamacpp import LlamaCppLM, LlamaCppWeights

    lm = LlamaCppLM(LlamaCppWeights.load(model_path, extra_buffers=True), n_ctx=256)
    tokens = filler_ids(lm.vocab_size, sum(TRIAL_PASSES))
    start = 0
    for size in TRIAL_PASSES:
        lm.forward(tokens[start : start + size])
        start += size


if __name__ == "__main__":
    _trial(sys.argv[1])
