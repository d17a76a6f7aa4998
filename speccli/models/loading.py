"""Load a named model and its tokenizer onto a device, in a dtype, quantized or not.

``load_model(name, LoadConfig(...))`` resolves the name (see ``registry.resolve``),
picks the device, dtype and quantization, and calls transformers. It is
``load_tokenizer`` (seconds) then ``load_weights`` (up to minutes): a caller can look
at the tokenizer, e.g. check a draft's against its target's, before any weights load.

Its parts: ``choices.py`` (device, dtype, quantization and backend for this model and machine),
``explain.py`` (what a user can cause, as one ModelLoadError line with a hint; anything else is
a bug and propagates), ``gguf_tokenizer.py`` (a GGUF file's tokenizer, converted once and kept),
``tensor_parallel.py`` (whether `--tp` can split a target), ``converted.py`` (a GGUF's
dequantized weights kept for later starts), ``onednn.py`` and ``int8.py`` (CPU kernels).

* float32 on the CPU: the linear layers run through oneDNN instead of MKL's sgemm
  (``LoadConfig.cpu_linear``; see ``speccli.models.kernels.onednn``), which is faster for the
  few rows a decode step feeds (where PyTorch's kernel wins for the fewest rows, it keeps
  them: timed at load). bfloat16 on the CPU: a one-token pass multiplies its row as two
  where that is measured faster (PyTorch's one-row bf16 kernel is slower than its two-row
  one on some CPUs).
* Hub models are looked up in the local Hugging Face cache first, without
  touching the network; only a model that is not (completely) cached is fetched.
  An offline machine thus loads cached models at once instead of retrying the Hub.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from speccli.backends.fused import fuse_projections
from speccli.config import LoadConfig
from speccli.models.formats import converted
from speccli.models.names import offline
from speccli.models.choices import (
    DTYPES,
    auto_cpu_dtype,
    bitsandbytes_problem,
    choose_backend,
    choose_device,
    choose_dtype,
    choose_quant,
    cpu_has_fast_bf16,
    dtype_name,
    int8_dtype,
)
from speccli.models.formats.converted import finish_conversions
from speccli.models.kernels.cpu import cpu_name
from speccli.models.errors import ModelLoadError
from speccli.models.explain import explaining, offline_mode, quiet_libraries
from speccli.models.formats.gguf_tokenizer import load_gguf_tokenizer
from speccli.models.kernels.int8 import quantize_int8
from speccli.models.kernels.onednn import (
    choose_stock_rows,
    onednn_problem,
    set_onednn_linear,
    set_two_row_linear,
    two_rows_pay,
)
from speccli.models.memory.plan import ALTERNATIVES, MemoryNeed, cached_hub_config, check_fits, memory_need, meta_model
from speccli.models.names.registry import ResolvedModel, resolve
from speccli.models.memory.tensor_parallel import check_heads_split, tensor_parallel_device
from speccli.models.kernels.torchao_quant import TORCHAO_QUANTS, torchao_config

__all__ = [  # and what the choices and the tensor-parallel check decide, as the commands name them
    "DTYPES",
    "LoadedModel",
    "PendingModel",
    "auto_cpu_dtype",
    "choose_device",
    "choose_dtype",
    "choose_quant",
    "cpu_has_fast_bf16",
    "check_heads_split",
    "check_tensor_parallel",
    "cpu_name",
    "dtype_name",
    "finish_conversions",
    "load_model",
    "load_tokenizer",
    "load_weights",
]

Progress = Callable[[str], None]


# Special tokens that end a generation whatever the config names, as llama.cpp treats them (its
# end-of-generation list). GGUF files often name one eos id only: Qwen2.5's names <|im_end|> but not
# <|endoftext|>, so a completion prompt ran on past the end of its text into unrelated code.
END_OF_GENERATION_TOKENS = (
    "<|endoftext|>",
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<|end|>",
    "<end_of_turn>",
    "<|return|>",
    "<|call|>",
    "<EOT>",
    "<｜end▁of▁sentence｜>",
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
        added: dict[str, int] = getattr(self.tokenizer, "get_added_vocab", dict)()
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
        linear = {
            "onednn": ", oneDNN linear",
            "two-row": ", one-row products as two",
            "fused": ", q/k/v and gate/up fused",
        }.get(self.linear, "")
        if self.stock_rows:
            fewest, most = min(self.stock_rows.values()), max(self.stock_rows.values())
            linear += f" from {fewest if fewest == most else f'{fewest}-{most}'} rows"
        return (
            f"{self.name}: {self.resolved.kind}, {dtype_name(self.dtype)}{quant}{linear} on {self.device},"
            f" loaded in {self.load_seconds:.1f} s"
        )


# --------------------------------------------------------------------------- device, dtype, quant


# --------------------------------------------------------------------------- errors


# --------------------------------------------------------------------------- loading


def _from_pretrained(fn: Callable[..., Any], resolved: ResolvedModel, kwargs: dict[str, Any]) -> Any:
    """Hub models: the local cache first, without a network round trip; the Hub only if that fails."""
    if resolved.kind == "hub" and not offline_mode():
        try:
            return fn(resolved.location, local_files_only=True, **kwargs)
        except OSError:
            pass
    return fn(resolved.location, **kwargs)


def _model_kwargs(
    resolved: ResolvedModel,
    dtype: torch.dtype,
    quant: str,
    device: torch.device,
    trust_remote_code: bool,
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
    memory: MemoryNeed | None = None  # on CUDA, what it needs there (speccli.models.memory.plan)


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
        device = tensor_parallel_device(name, config, peek)
    backend = choose_backend(config, peek, device)
    if backend == "llama.cpp":
        quant, dtype = "none", torch.float32  # the weights keep the file's quantization; logits are float32
    else:
        quant = (
            "none" if config.tp > 1 else choose_quant(config.quant, device, gguf=peek.is_gguf, draft=config.for_draft)
        )
        dtype = int8_dtype(config) if quant == "int8" else choose_dtype(config.dtype, device, quant)
        if quant == "int4" and dtype != torch.bfloat16:
            raise ModelLoadError(
                f"--quant int4 (torchao's tinygemm kernel) computes in bfloat16, not {dtype_name(dtype)}",
                hint="drop --dtype, or use --dtype bfloat16",
            )
    if config.quant == "auto" and device.type == "cuda" and quant == "none" and not peek.is_gguf:
        say(f"bitsandbytes is unavailable ({bitsandbytes_problem()}): loading {name} unquantized")
    resolved = resolve(name, cache, progress, byte_progress=byte_progress) if peek.kind == "offline-package" else peek

    from transformers import AutoTokenizer

    with explaining(name, resolved, quant, device):
        if resolved.is_gguf:
            tokenizer = load_gguf_tokenizer(resolved, cache, say)
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


def load_config(
    name: str,
    cache_dir: Path | None = None,
    trust_remote_code: bool = False,
    progress: Progress | None = None,
    *,
    shapes_only: bool = False,
) -> tuple[ResolvedModel, Any]:
    """A model's transformers config and where it lives, without its weights: config.json from
    a folder or the Hub, a GGUF file's header (an offline package is assembled first).
    `shapes_only`: for sizing, a registered model whose config is not on this machine takes
    the shapes registered for it instead of the Hub's (speccli.models.names.shapes)."""
    from speccli.models.names.shapes import shape_config

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
    with explaining(name, resolved, "none", torch.device("cpu")):
        return resolved, _model_config(resolved, trust_remote_code)


def _model_config(resolved: ResolvedModel, trust_remote_code: bool) -> Any:
    """The config of a resolved model: its GGUF header, or config.json (the Hub's cache first)."""
    from transformers import AutoConfig

    from speccli.models.formats.gguf_weights import gguf_config

    if resolved.is_gguf:
        path = resolved.gguf_path
        assert path is not None  # a GGUF model has its file
        return gguf_config(path)
    return _from_pretrained(AutoConfig.from_pretrained, resolved, {"trust_remote_code": trust_remote_code})


def model_config(pending: PendingModel) -> Any:
    """The transformers config of a model whose tokenizer is loaded, without its weights."""
    with explaining(pending.name, pending.resolved, pending.quant, pending.device):
        return _model_config(pending.resolved, pending.config.trust_remote_code)


def check_memory(
    name: str,
    resolved: ResolvedModel,
    quant: str,
    dtype: torch.dtype,
    device: torch.device,
    trust_remote_code: bool,
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
    quiet_libraries()
    cache = pending.cache_dir or offline.default_cache_dir()
    gguf_path = resolved.gguf_path
    keeping = resolved.is_gguf and config.keep_converted and not converted.disabled_by_environment()
    conversion = converted.identity(gguf_path, dtype_name(dtype)) if keeping and gguf_path is not None else None
    keep: Callable[[], None] = lambda: None  # noqa: E731  (starts writing the conversion, once)
    kept = converted.lookup(cache, conversion, say) if conversion is not None else None
    # A transformers PreTrainedModel, typed as the nn.Module it is: its `to` is wrapped by a
    # decorator that mypy does not bind as a method, and int8 quantization returns a Module.
    model: torch.nn.Module | None = None
    if kept is not None:
        say(f"loading {name}: {dtype_name(dtype)} weights converted earlier from {resolved.gguf_file} ({kept})")
        try:
            model = AutoModelForCausalLM.from_pretrained(str(kept), **_converted_kwargs(dtype, device))
        except Exception as error:  # noqa: BLE001 - an entry that cannot be read is never used: the GGUF is
            if isinstance(error, (MemoryError, torch.OutOfMemoryError)):
                raise  # the entry is fine; the device is full
            converted.discard(kept)
            say(
                f"the converted weights in {kept} could not be read ({type(error).__name__}): removed, converting again"
            )
            kept = None
    with explaining(name, resolved, quant, device):
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
                keep = converted.keeper(model, cache, conversion, name, say)
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
    from speccli.models.formats import gguf_weights

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


def _load_llama_cpp(pending: PendingModel, say: Progress, started: float) -> LoadedModel:
    from speccli.backends.llamacpp import LlamaCppError, LlamaCppWeights
    from speccli.models.kernels.llamacpp_check import extra_buffers_verdict

    path = pending.resolved.gguf_path
    assert path is not None  # choose_backend takes llama.cpp for GGUF files only
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
    tensor_parallel_device(name, config, resolve(name, cache, assemble=False))
    _, model_config = load_config(name, cache, config.trust_remote_code, shapes_only=True)
    check_heads_split(name, model_config, config.tp)
