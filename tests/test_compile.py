"""`--compile on`: the static-cache backend's passes through torch.compile (on the CPU here,
where inductor compiles C++): the same tokens as the target's own greedy decoding, chains and
trees; a pass that cannot compile runs eagerly; the option where it cannot apply."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import save_model_folder, tiny_llama, wrap, wrap_static
from speccli.config import SamplingConfig, SpecConfig
from speccli.drafters.model import ModelDrafter
from speccli.loop import SpeculativeDecoder
from test_decoder_greedy import EOS, PROMPTS, emitted, encode, target_greedy

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_compiled_passes_keep_the_targets_greedy_tokens(pairs, tokenizer, tmp_path, monkeypatch):
    from speccli.pipeline import backend_label

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    pair = pairs[0]
    target = wrap_static(pair.target, compile=True)
    decoder = SpeculativeDecoder(target, tokenizer, [EOS], ModelDrafter(wrap(pair.draft), len(tokenizer)))
    for prompt in PROMPTS[:2]:
        ids = encode(tokenizer, prompt)
        for spec in (SpecConfig(k=4, max_new_tokens=16), SpecConfig(k=3, max_new_tokens=16, tree=True)):
            assert emitted(decoder.generate(ids, SamplingConfig(), spec)) == target_greedy(pair.target, ids)[:16]
    assert target.compile_error is None and backend_label(target) == "static-cache+compile"
    assert target.setup_seconds > 0.5  # the compiles, kept out of the steps' timings
    assert any((tmp_path / "inductor").iterdir())  # what was compiled is kept


def test_a_pass_that_cannot_compile_runs_eagerly(pairs, tokenizer, monkeypatch):
    def broken(model, **kwargs):
        def fails(**inputs):
            raise RuntimeError("inductor: no compiler")

        return fails

    monkeypatch.setattr(torch, "compile", broken)
    pair = pairs[1]
    target = wrap_static(pair.target, compile=True)
    ids = encode(tokenizer, "def fib(n):")
    torch.testing.assert_close(target.forward(ids[:1]), wrap(pair.target).forward(ids[:1]), rtol=1e-5, atol=1e-5)
    assert not target.compile_enabled and target.compile_error == "RuntimeError: inductor: no compiler"


def specgen(tmp_path, folder: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "speccli.cli",
            "generate",
            "abc",
            "--target",
            folder,
            "--draft",
            "none",
            "--dtype",
            "float32",
            "-n",
            "6",
            "--json",
            "-q",
            *args,
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(REPO), "SPECGEN_CACHE": str(tmp_path / "cache")},
    )


@pytest.mark.slow
def test_generate_compile_on_reports_it_and_gives_the_same_tokens(tmp_path, tokenizer):
    model = tiny_llama(len(tokenizer), seed=3, logit_scale=20.0)
    folder = str(save_model_folder(model, tokenizer, tmp_path / "target"))
    plain = specgen(tmp_path, folder, "--compile", "off")
    compiled = specgen(tmp_path, folder, "--compile", "on")
    assert plain.returncode == 0 and compiled.returncode == 0, compiled.stderr
    plain_out, compiled_out = json.loads(plain.stdout), json.loads(compiled.stdout)
    assert plain_out["settings"]["backend"] == "dynamic-cache"
    assert compiled_out["settings"]["backend"] == "static-cache+compile"
    assert compiled_out["token_ids"] == plain_out["token_ids"]
    assert (tmp_path / "cache" / "inductor").is_dir()


def test_compile_takes_auto_on_or_off(tmp_path, tokenizer):
    folder = str(save_model_folder(tiny_llama(len(tokenizer), seed=3), tokenizer, tmp_path / "target"))
    bad = specgen(tmp_path, folder, "--compile", "yes")
    assert bad.returncode == 2 and "compile must be one of auto, on, off" in bad.stderr


def test_compile_on_refuses_the_llama_cpp_backend():
    from speccli.models.errors import ModelLoadError
    from speccli.pipeline import causal_lm

    class LlamaCppLoaded:
        name, backend, model = "tiny.gguf", "llama.cpp", None

    with pytest.raises(ModelLoadError, match="--compile on cannot apply to tiny.gguf: it runs through llama.cpp"):
        causal_lm(LlamaCppLoaded(), compile="on")
