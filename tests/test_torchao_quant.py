"""`--quant int4|fp8` (speccli.models.kernels.torchao_quant): where they can run, what transformers is
asked for, and the one-line errors elsewhere. The kernels themselves need CUDA (gpu_check)."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from speccli.cli import app
from speccli.models import loading
from speccli.models.kernels import torchao_quant
from speccli.models.errors import ModelLoadError
from speccli.models.loading import choose_quant
from speccli.models.names.registry import ResolvedModel

CPU, CUDA0 = torch.device("cpu"), torch.device("cuda", 0)


@pytest.fixture
def gpu(monkeypatch):
    """A CUDA device of the given compute capability, as far as the checks ask."""

    def with_capability(major: int, minor: int) -> None:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, minor))
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Test GPU")

    monkeypatch.setattr(torchao_quant, "torchao_problem", lambda: None)
    return with_capability


def test_int4_and_fp8_run_on_cuda(gpu):
    gpu(9, 0)
    assert choose_quant("int4", CUDA0) == "int4" and choose_quant("fp8", CUDA0) == "fp8"
    assert choose_quant("nf4", CUDA0) == "4bit"  # bitsandbytes' NF4 by its name
    assert choose_quant("auto", CUDA0) == "4bit"  # until a GPU measurement says otherwise


def test_fp8_needs_fp8_units(gpu):
    gpu(8, 0)
    with pytest.raises(ModelLoadError) as info:
        choose_quant("fp8", CUDA0)
    assert str(info.value) == "--quant fp8 needs FP8 units (compute capability 8.9 or later); NVIDIA Test GPU has 8.0"
    assert info.value.hint == "use --quant int4 or 4bit"


@pytest.mark.parametrize("quant", ["int4", "fp8"])
def test_torchao_quants_are_refused_off_cuda_on_gguf_and_without_torchao(gpu, monkeypatch, quant):
    gpu(9, 0)
    with pytest.raises(
        ModelLoadError, match=f"--quant {quant} is torchao's {quant} weight-only quantization, which runs on CUDA only"
    ):
        choose_quant(quant, CPU)
    with pytest.raises(ModelLoadError, match="cannot apply to a GGUF file"):
        choose_quant(quant, CUDA0, gguf=True)
    monkeypatch.setattr(torchao_quant, "torchao_problem", lambda: "ModuleNotFoundError: No module named 'torchao'")
    with pytest.raises(ModelLoadError) as info:
        choose_quant(quant, CUDA0)
    assert "needs torchao, which cannot be imported here (ModuleNotFoundError" in str(info.value)
    assert info.value.hint == torchao_quant.INSTALL_HINT


def test_int4_asks_transformers_for_tinygemm_groups_of_128_placed_on_the_gpu():
    pytest.importorskip("torchao")
    folder = ResolvedModel("local-folder", "/models/x", None, "a folder")
    kwargs = loading._model_kwargs(folder, torch.bfloat16, "int4", CUDA0, False)
    config = kwargs["quantization_config"].quant_type
    assert type(config).__name__ == "Int4WeightOnlyConfig"
    assert config.group_size == 128 and str(config.int4_packing_format).endswith("tile_packed_to_4d")
    assert kwargs["device_map"] == {"": CUDA0} and kwargs["dtype"] is torch.bfloat16
    fp8 = loading._model_kwargs(folder, torch.bfloat16, "fp8", CUDA0, False)["quantization_config"].quant_type
    assert type(fp8).__name__ == "Float8WeightOnlyConfig"


def test_the_cli_refuses_int4_on_the_cpu_in_one_line(tmp_path, monkeypatch, tokenizer):
    from conftest import save_model_folder, tiny_llama

    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path))
    folder = save_model_folder(tiny_llama(len(tokenizer), seed=1), tokenizer, tmp_path / "model")
    result = CliRunner().invoke(
        app, ["generate", "hi", "--device", "cpu", "--quant", "int4", "--draft", "none", "--target", str(folder)]
    )
    assert result.exit_code == 2
    assert "--quant int4 is torchao's int4 weight-only quantization, which runs on CUDA only" in result.stderr
    assert "Traceback" not in result.stderr
