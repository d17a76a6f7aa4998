"""Which device, dtype, quantization and backend a model loads with, for this model, these
options and this machine: the choices `load_tokenizer` makes before anything loads.

* dtype ``auto``: bfloat16 on CUDA (float16 on GPUs without bf16); on the CPU bfloat16 only
  where the CPU multiplies bf16 natively, else float32 (see :func:`auto_cpu_dtype`).
* quant ``auto``: NF4 4-bit on CUDA. On the CPU none for a target, and PyTorch's dynamic int8
  for a draft (``LoadConfig.for_draft``): that halves a draft token's cost there (see
  ``speccli.models.kernels.int8``). GGUF files are never re-quantized by bitsandbytes: transformers
  dequantizes them to the dtype.
"""

from __future__ import annotations

import functools

import torch

from speccli.config import QUANTS, LoadConfig
from speccli.models.kernels.cpu import cpuinfo_field
from speccli.models.errors import ModelLoadError
from speccli.models.explain import first_line, quiet_libraries
from speccli.models.kernels.int8 import int8_problem
from speccli.models.names.registry import ResolvedModel
from speccli.models.kernels.torchao_quant import TORCHAO_QUANTS, check_torchao_quant


DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _no_cuda_hint() -> str:
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return "this torch build is CPU-only: install a CUDA build of torch (https://pytorch.org), or use --device cpu"
    return "check the NVIDIA driver and CUDA_VISIBLE_DEVICES, or use --device cpu"


def choose_device(requested: str) -> torch.device:
    """auto: the current CUDA device if there is one, else the CPU. Raises ModelLoadError."""
    req = requested.strip().lower()
    if req == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    if req == "cpu":
        return torch.device("cpu")
    if req == "cuda" or req.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise ModelLoadError(
                f"--device {requested} was asked for, but torch sees no CUDA device", hint=_no_cuda_hint()
            )
        if req == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        try:
            index = int(req.split(":", 1)[1])
        except ValueError:
            raise ModelLoadError(f"bad device {requested!r}", hint="use auto, cpu, cuda or cuda:N") from None
        count = torch.cuda.device_count()
        if not 0 <= index < count:
            raise ModelLoadError(
                f"--device {requested}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}",
                hint="pick one of those, or use --device cuda",
            )
        return torch.device("cuda", index)
    raise ModelLoadError(f"unknown device {requested!r}", hint="use auto, cpu, cuda or cuda:N")


def _cpu_flags() -> set[str]:
    return set((cpuinfo_field("flags") or "").split())


@functools.lru_cache(maxsize=None)
def cpu_has_fast_bf16() -> bool:
    """True when this CPU multiplies bfloat16 natively (AMX-BF16 or AVX512-BF16) and torch uses AVX512.

    Reads /proc/cpuinfo's flags; where there is none (not Linux), asks torch's own probes.
    """
    capability = torch.backends.cpu.get_cpu_capability()
    if not capability.upper().startswith(("AVX512", "AMX")):
        return False
    flags = _cpu_flags()
    if flags:
        return bool(flags & {"amx_bf16", "avx512_bf16"})
    for probe in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"):
        fn = getattr(torch.cpu, probe, None)
        try:
            if fn is not None and fn():
                return True
        except Exception:  # pragma: no cover - private API
            pass
    return False


def auto_cpu_dtype(quant: str = "none") -> torch.dtype:
    """The dtype ``--dtype auto`` means on the CPU. One place, to retune after benchmarking.

    bfloat16 where the CPU has native bf16 matmuls (AMX-BF16, AVX512-BF16), float32
    elsewhere, where bf16 is emulated and slower than float32. With native bf16 matmuls a
    bf16 pass's cost grows little with the new tokens it is fed, while float32's grows much
    faster; that flat verify cost is what speculative decoding lives on
    (measured: BENCHMARKS.md, sections "2-core Intel Xeon with AMX" and "2-core AMD EPYC,
    AVX512-BF16, no AMX"). GGUF files load about as fast in bf16 as in float32.

    The price: in bf16 a pass over k+1 tokens rounds differently from k+1 one-token passes
    (|logit diff| about 0.06 on the tiny test models), so at a near-tie greedy speculative
    output can differ from the target's own token-by-token ``generate``; in float32 they
    match exactly. ``quant`` is not used yet: bitsandbytes on the CPU computes in this dtype too.
    """
    del quant
    return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32


def choose_dtype(requested: str, device: torch.device, quant: str = "none") -> torch.dtype:
    """auto: bfloat16 on CUDA (float16 where the GPU lacks bf16), :func:`auto_cpu_dtype` on the CPU."""
    if requested == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return auto_cpu_dtype(quant)
    try:
        dtype = DTYPES[requested]
    except KeyError:
        raise ModelLoadError(f"unknown dtype {requested!r}", hint="use auto, " + ", ".join(DTYPES)) from None
    if device.type == "cuda" and dtype is torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise ModelLoadError(
            f"--dtype bfloat16 was asked for, but {torch.cuda.get_device_name(device)} does not support it",
            hint="use --dtype float16 (or auto)",
        )
    return dtype


@functools.lru_cache(maxsize=None)
def bitsandbytes_problem() -> str | None:
    """None when bitsandbytes imports, else why it does not."""
    quiet_libraries()
    try:
        import bitsandbytes  # noqa: F401
    except Exception as exc:  # ImportError, or a broken native library
        return first_line(f"{type(exc).__name__}: {exc}")
    return None


def int8_dtype(config: LoadConfig) -> torch.dtype:
    """int8 layers take and give float32. An inherited --dtype (auto quant) yields to that;
    an explicit --quant int8 with another dtype is a contradiction worth saying."""
    if config.quant == "int8" and config.dtype not in ("auto", "float32"):
        raise ModelLoadError(
            f"--quant int8 computes in float32 around int8 weights, not in {config.dtype}",
            hint="drop --dtype (or --draft-dtype) for this model, or use --quant none",
        )
    return torch.float32


def choose_quant(requested: str, device: torch.device, *, gguf: bool = False, draft: bool = False) -> str:
    """ "none", "4bit" (bitsandbytes NF4; `nf4` names it too), "8bit", "int8", "int4" or "fp8".
    auto: 4bit on CUDA (none if bitsandbytes is missing); on the CPU, int8 (PyTorch dynamic)
    for a draft and none for a target. int4 and fp8 are torchao's, on CUDA only
    (speccli.models.kernels.torchao_quant).

    A GGUF file is dequantized, never re-quantized: auto and none give "none" (int8 for a
    draft on the CPU), and an explicit 4bit/8bit/int4/fp8 is a ModelLoadError.
    """
    if requested not in QUANTS:
        raise ModelLoadError(f"unknown quantization {requested!r}", hint="use " + ", ".join(QUANTS))
    if requested == "nf4":
        requested = "4bit"
    if requested in TORCHAO_QUANTS:
        check_torchao_quant(requested, device, gguf=gguf)
        return requested
    if requested == "int8":
        if device.type != "cpu":
            raise ModelLoadError(
                "--quant int8 is PyTorch's dynamic int8 quantization, which runs on the CPU only",
                hint="on CUDA use --quant 4bit or 8bit (bitsandbytes)",
            )
        problem = int8_problem()
        if problem is not None:
            raise ModelLoadError(f"--quant int8 is not available: {problem}", hint="use --quant none")
        return "int8"
    if requested == "auto" and draft and device.type == "cpu":
        return "int8" if int8_problem() is None else "none"
    if gguf:
        if requested in ("auto", "none"):
            return "none"
        raise ModelLoadError(
            f"--quant {requested} cannot apply to a GGUF file: transformers dequantizes GGUF weights "
            "to float32/bfloat16 when it loads them, and bitsandbytes cannot re-quantize those",
            hint="drop --quant to load the GGUF dequantized, or use a safetensors model (a folder or Hub id) "
            f"for --quant {requested}",
        )
    if requested == "auto":
        if device.type != "cuda":
            return "none"
        return "4bit" if bitsandbytes_problem() is None else "none"
    if requested == "none":
        return "none"
    problem = bitsandbytes_problem()
    if problem is not None:
        raise ModelLoadError(
            f"--quant {requested} needs bitsandbytes, which cannot be imported here ({problem})",
            hint="pip install bitsandbytes (0.48 or later also quantizes on the CPU), or use --quant none",
        )
    return requested


def choose_backend(config: LoadConfig, resolved: ResolvedModel, device: torch.device) -> str:
    """ "transformers" or "llama.cpp". auto takes llama.cpp for a GGUF file on the CPU when
    llama-cpp-python is installed and no --dtype or --quant asks for transformers' own
    dequantized weights; an explicit llama.cpp that cannot apply is a ModelLoadError."""
    from speccli.backends.llamacpp import INSTALL_HINT, llama_cpp_problem

    if config.backend == "transformers":
        return "transformers"
    if config.backend == "auto":
        fits = resolved.is_gguf and device.type == "cpu" and config.dtype == "auto" and config.quant == "auto"
        return "llama.cpp" if fits and llama_cpp_problem() is None else "transformers"
    if not resolved.is_gguf:
        raise ModelLoadError(
            f"--backend llama.cpp runs GGUF files, and {resolved.description} is not one",
            hint="give a .gguf file or an offline alias (specgen models), or drop --backend",
        )
    if device.type != "cpu":
        raise ModelLoadError(
            f"--backend llama.cpp runs on the CPU here, not on {device}",
            hint="add --device cpu, or use --backend transformers for the GPU",
        )
    if config.dtype != "auto" or config.quant != "auto":
        raise ModelLoadError(
            "--backend llama.cpp runs the GGUF file's own quantization: --dtype and --quant do not apply",
            hint="drop --dtype/--quant, or use --backend transformers to dequantize the file",
        )
    problem = llama_cpp_problem()
    if problem is not None:
        raise ModelLoadError(f"--backend llama.cpp is not available: {problem}", hint=INSTALL_HINT)
    return "llama.cpp"
