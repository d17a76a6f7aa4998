"""`specgen plan` and its arithmetic (speccli.models.memory.plan) on the Llama-3 70B and 8B configs
(tests/data), checked against figures computed by hand from the architecture."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from speccli.cli import app
from speccli.models.loading import load_config
from speccli.models.memory.plan import memory_need, meta_model, plan_pair

DATA = Path(__file__).parent / "data"
BF16 = torch.bfloat16

# Per decoder layer of Llama-3-70B: q and o 8192 x 8192, k and v 8192 x 1024, gate/up/down
# 8192 x 28672; two norms of 8192. Embeddings and head 128256 x 8192 each; a final norm.
LAYER_70B_MATRICES = 2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672
EMBEDDINGS_70B = 2 * 128256 * 8192
NORMS_70B = 80 * 2 * 8192 + 8192
PARAMS_70B = 80 * LAYER_70B_MATRICES + EMBEDDINGS_70B + NORMS_70B
PARAMS_8B = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096) + 2 * 128256 * 4096 + 4096


@pytest.fixture(scope="module")
def llama70b():
    return meta_model(load_config(str(DATA / "llama3-70b"))[1])


@pytest.fixture(scope="module")
def llama8b():
    return meta_model(load_config(str(DATA / "llama3-8b"))[1])


def test_the_hand_computed_sizes(llama70b, llama8b):
    assert PARAMS_70B == 70_553_706_496 and PARAMS_8B == 8_030_261_248
    assert memory_need(llama70b, "none", BF16).weights == 2 * PARAMS_70B  # 141.1 GB
    assert memory_need(llama8b, "none", BF16).weights == 2 * PARAMS_8B
    # int4: the decoder's matrices at 0.5 byte plus a bf16 scale and zero per 128; the rest bf16.
    int4 = 80 * LAYER_70B_MATRICES * (0.5 + 4 / 128) + 2 * (EMBEDDINGS_70B + NORMS_70B)
    assert memory_need(llama70b, "int4", BF16).weights == pytest.approx(int4) and round(int4) == 40_569_946_112
    # Two GPUs: every matrix halved, the norms on both.
    assert (
        memory_need(llama70b, "none", BF16, tp=2).weights == (80 * LAYER_70B_MATRICES + EMBEDDINGS_70B) + 2 * NORMS_70B
    )
    # KV cache: 2 (keys, values) x 80 layers x 8 heads x 128 x tokens x 2 bytes; heads split over GPUs.
    assert memory_need(llama70b, "none", BF16, kv_tokens=8192).kv_cache == 2 * 80 * 8 * 128 * 8192 * 2
    assert memory_need(llama70b, "none", BF16, kv_tokens=8192, tp=2).kv_cache == 2 * 80 * 4 * 128 * 8192 * 2


def test_a_pair_too_large_is_told_what_fits(llama70b, llama8b):
    plan = plan_pair("llama3-70b", llama70b, "llama3-8b", llama8b, "none", "none", BF16, gpu_bytes=80e9, gpus=8)
    assert plan_pair("llama3-70b", llama70b, None, None, "none", "none", BF16, gpu_bytes=80e9, gpus=1).suggestions[
        0
    ] == ("use --tp 2 on 2 80 GB GPUs (this machine has 1)")
    assert plan.fits is False
    assert plan.verdict() == (
        "llama3-70b in none needs 141 GB of weights (168.9 GB with the draft): "
        "use --tp 4 on 4 80 GB GPUs, or --quant int4, 41 GB, on one"
    )
    alone = plan_pair("llama3-70b", llama70b, None, None, "none", "none", BF16, gpu_bytes=80e9, gpus=2)
    assert alone.suggestions[0] == "use --tp 2 on 2 80 GB GPUs"
    assert plan_pair("llama3-70b", llama70b, "llama3-8b", llama8b, "int4", "int4", BF16, gpu_bytes=80e9).fits


def run_plan(*args: str):
    return CliRunner().invoke(
        app, ["plan", "--target", str(DATA / "llama3-70b"), "--draft", str(DATA / "llama3-8b"), "-q", *args]
    )


def test_plan_exits_2_when_the_pair_does_not_fit_and_0_when_it_does():
    refused = run_plan("--quant", "none", "--gpu-memory", "80")
    assert refused.exit_code == 2, refused.output
    assert "use --tp 4 on 4 80 GB GPUs" in refused.stdout and "141.1 GB" in refused.stdout
    fits = run_plan("--quant", "int4", "--gpu-memory", "80", "--json")
    assert fits.exit_code == 0
    plan = json.loads(fits.stdout)
    assert (
        plan["fits"] is True and plan["target_weights"] == 40_569_946_112 and plan["draft_on_first_gpu"]["weights"] > 0
    )
    split = json.loads(run_plan("--quant", "none", "--gpu-memory", "80", "--tp", "4", "--json").stdout)
    assert split["fits"] is True and split["tp"] == 4


def test_plan_without_gpu_memory_gives_the_figures_alone(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = run_plan("--quant", "4bit", "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["fits"] is None
    assert "give --gpu-memory GB" in json.loads(result.stdout)["verdict"]


def test_plan_checks_its_options():
    bad = run_plan("--quant", "3bit")
    assert bad.exit_code == 2 and "--quant takes none, 8bit, 4bit, int4, fp8, not '3bit'" in bad.stderr
