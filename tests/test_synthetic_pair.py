"""scripts/synthetic_pair.py at its tiny scale: three loadable folders, a self draft that is the
target's first layers and agrees with it on most greedy tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import char_tokenizer

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_tiny_synthetic_pair(tmp_path):
    tokenizer_folder = tmp_path / "tokenizer"
    char_tokenizer().save_pretrained(tokenizer_folder)
    out = tmp_path / "pair"
    result = subprocess.run(
        [
            sys.executable,
            "scripts/synthetic_pair.py",
            str(out),
            "--scale",
            "tiny",
            "--tokenizer",
            str(tokenizer_folder),
            "--dtype",
            "float32",
        ],
        capture_output=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=600,
    )
    assert result.returncode == 0, result.stderr.decode()
    info = json.loads((out / "synthetic.json").read_text())
    assert info["self_draft_agreement"] > 0.5 > info["draft_agreement"]
    target = AutoModelForCausalLM.from_pretrained(out / "target")
    self_draft = AutoModelForCausalLM.from_pretrained(out / "self-draft")
    draft = AutoModelForCausalLM.from_pretrained(out / "draft")
    assert (target.config.num_hidden_layers, self_draft.config.num_hidden_layers) == (6, 2)
    assert draft.config.hidden_size == 32 and draft.config.vocab_size == 151936
    torch.testing.assert_close(self_draft.lm_head.weight, target.lm_head.weight)
    torch.testing.assert_close(
        self_draft.model.layers[1].mlp.down_proj.weight, target.model.layers[1].mlp.down_proj.weight
    )
    assert (out / "target" / "tokenizer_config.json").is_file()
