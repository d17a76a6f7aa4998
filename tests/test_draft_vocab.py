"""Drafts whose tokenizers do not match their target's: refused before any weights load."""

from __future__ import annotations

from typer.testing import CliRunner

from conftest import char_tokenizer, save_model_folder, tiny_llama
from speccli.cli import app


def test_a_mismatched_draft_is_refused_before_its_weights_load(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path / "cache"))
    target_tok, draft_tok = char_tokenizer(), char_tokenizer("zyxwvutsrqponmlkjihgfedcba")
    target = save_model_folder(tiny_llama(len(target_tok), seed=1), target_tok, tmp_path / "target")
    draft = save_model_folder(tiny_llama(len(draft_tok), seed=2), draft_tok, tmp_path / "draft")
    (draft / "model.safetensors").write_bytes(b"not weights")
    result = CliRunner().invoke(app, ["generate", "hi", "--target", str(target), "--draft", str(draft), "-q"])
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert lines[0] == "error: tokenizers differ at id 3: target 'a' vs draft 'z' (26 of 29 shared ids differ)"
    assert lines[1].startswith("hint: pick a draft of the same model family")
    assert "Traceback" not in result.stderr
