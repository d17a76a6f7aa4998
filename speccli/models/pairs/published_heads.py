"""Draft heads others trained and published, in the layouts they are published in:
EAGLE-3 (SafeAILab, SpecForge, speculators), EAGLE-1/2 (SafeAILab) and Medusa-1
(FasterDecoding). A head is a Hub id or a local folder; its config (and for Medusa its
tensors' shapes) is checked against the target before any weights are read.

What each layout is, from the sources it is read as (SafeAILab/EAGLE `cnets.py`,
`cnets1.py`; vLLM and SGLang `llama_eagle3.py`; FasterDecoding `medusa_model.py`):

- EAGLE-3: a Llama config with one layer and `draft_vocab_size` (speculators nest it in
  `transformer_layer_config`); `fc` [H, 3H], `midlayer.*` (or `layers.0.*`), `norm`,
  `lm_head` [draft vocab, H], `d2t` (target id = draft id + d2t[draft id]); the target's
  embedding. Features: the residual stream entering target layers 2, L//2 and L-3, unless
  the config names them (see `feature_layers`).
- EAGLE-1/2: `fc` [H, 2H] (bias unless `"bias": false`) and `layers.0.*` without
  `input_layernorm`; the target's embedding and output layer; features: the target's last
  hidden state after its final norm.
- Medusa: `medusa_lm_head.{safetensors,pt}`, `{h}.{l}.linear.weight/bias` and
  `{h}.{layers}.weight`; head h guesses the token h + 2 places after the feature's.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from speccli.models.pairs.drafts import LAYOUT_NAMES
from speccli.models.errors import HeadsMismatch, ModelLoadError

HUB_FILES = ["*.json", "*.safetensors", "*.bin", "*.pt"]
# Where a head's config names the target layers it reads, and in which convention:
# - "entering": id i is the input of layer i (transformers' hidden_states[i]), as vLLM reads the
#   top-level `eagle_aux_hidden_state_layer_ids` (speculators' configs);
# - "output of": id i is layer i's output, the input of layer i + 1, as SGLang reads
#   `eagle_config.eagle_aux_hidden_state_layer_ids` (SpecForge's configs) and trainers write
#   `target_layer_ids`.
# (place, key, added to each id); the first found wins.
LAYER_ID_KEYS = (
    ("top", "eagle_aux_hidden_state_layer_ids", 0),
    ("top", "aux_hidden_state_layer_ids", 0),
    ("eagle_config", "eagle_aux_hidden_state_layer_ids", 1),
    ("top", "target_layer_ids", 1),
    ("eagle_config", "target_layer_ids", 1),
)
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class HeadUnavailable(ModelLoadError):
    """A Hub head that is neither in the local cache nor downloadable now (offline, gated, gone)."""


def default_feature_layers(target_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's features when a head's config names none: the inputs of layers 2, L//2, L-3."""
    return (2, target_layers // 2, target_layers - 3)


@dataclass(frozen=True)
class PublishedHead:
    """A published head's files, read as far as its config and tensor shapes."""

    layout: str
    source: str  # as given: a Hub id or a folder
    folder: Path
    config: dict[str, Any]
    weights: tuple[Path, ...]

    @property
    def label(self) -> str:
        return f"{LAYOUT_NAMES[self.layout]} head {self.source}"

    @property
    def layer_config(self) -> dict[str, Any]:
        """The head's own decoder-layer config (speculators nest it), with the head-level keys."""
        nested = self.config.get("transformer_layer_config")
        merged = dict(nested) if isinstance(nested, dict) else dict(self.config)
        for key in ("draft_vocab_size", "target_hidden_size", "norm_before_residual"):
            if key in self.config:
                merged[key] = self.config[key]
        return merged

    @property
    def base_model(self) -> str | None:
        """The target the publisher trained it for, where the config says."""
        verifier = (self.config.get("speculators_config") or {}).get("verifier") or {}
        name = self.config.get("base_model_name_or_path") or verifier.get("name_or_path")
        return str(name) if name else None

    def feature_layers(self, target_layers: int) -> tuple[int, ...]:
        """For EAGLE-3: the target layers whose inputs it reads, as transformers'
        hidden_states indices, whichever convention its config names them in."""
        places = {"top": {**self.layer_config, **self.config}, "eagle_config": self.config.get("eagle_config") or {}}
        for place, key, shift in LAYER_ID_KEYS:
            ids = places[place].get(key)
            if ids:
                return tuple(int(i) + shift for i in ids)
        return default_feature_layers(target_layers)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape, from the files' headers (safetensors) or their index
        (a memory-mapped torch.load): no tensor data is read."""
        out: dict[str, tuple[int, ...]] = {}
        for path in self.weights:
            if path.suffix == ".safetensors":
                out.update(_read_safetensors(path, shapes_only=True))
            else:
                out.update({k: tuple(v.shape) for k, v in _torch_load(path, mmap=True).items()})
        return out

    def tensors(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for path in self.weights:
            if path.suffix == ".safetensors":
                out.update(_read_safetensors(path, shapes_only=False))
            else:
                out.update(_torch_load(path, mmap=False))
        return out


def _read_safetensors(path: Path, shapes_only: bool) -> dict:
    """A safetensors file's tensors, or (shapes_only) their shapes from its header; a file
    that is truncated or not safetensors is a HeadsMismatch, one line, not a traceback."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            if shapes_only:
                return {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}
            return {key: handle.get_tensor(key) for key in handle.keys()}
    except Exception as error:  # noqa: BLE001 - SafetensorError, OSError: any unreadable file is the same answer
        raise HeadsMismatch(
            f"{path} cannot be read as safetensors ({error})",
            hint="download the head again, or point to an intact copy",
        ) from None


def _torch_load(path: Path, mmap: bool) -> dict[str, torch.Tensor]:
    """A .bin/.pt state dict, never unpickled freely (weights_only)."""
    try:
        loaded = torch.load(str(path), map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as error:  # noqa: BLE001 - any unreadable file is the same answer
        raise HeadsMismatch(f"{path} cannot be read as a state dict of tensors: {error}") from None
    if not isinstance(loaded, dict) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
        raise HeadsMismatch(f"{path} is not a state dict of tensors")
    return loaded


def looks_like_hub_id(source: str) -> bool:
    return bool(HUB_ID.match(source)) and not Path(source).expanduser().exists()


def fetch(source: str, progress: Callable[[str], None] | None = None) -> Path:
    """The folder holding a head: `source` itself, or its Hub snapshot (the local copy first;
    downloaded only when there is none)."""
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise HeadsMismatch(
            f"{source} is a file: a published head is a folder (config.json and its weights)",
            hint="give the folder, or a Hub id",
        )
    if not looks_like_hub_id(source):
        raise HeadsMismatch(f"no head at {source}: neither a folder nor a Hub id (owner/name)")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(source, allow_patterns=HUB_FILES, local_files_only=True))
    except Exception:  # noqa: BLE001 - not in the local cache: download below
        pass
    if progress is not None:
        progress(f"downloading {source} from the Hugging Face Hub")
    try:
        return Path(snapshot_download(source, allow_patterns=HUB_FILES))
    except Exception as error:  # noqa: BLE001 - offline, unknown repo, gated: one line either way
        raise HeadUnavailable(
            f"cannot download the head {source}: {str(error).splitlines()[0] if str(error) else type(error).__name__}",
            hint=f"where the Hub is reachable, `hf download {source} --local-dir DIR`; then give its folder"
            " (e.g. --draft eagle3:DIR)",
        ) from None


def read_head(source: str, layout: str, progress: Callable[[str], None] | None = None) -> PublishedHead:
    """A head's config and weight files, in the layout `layout` names; HeadsMismatch when the
    files are another layout's (saying which) or are not a head."""
    folder = fetch(source, progress)
    config_path = folder / "config.json"
    config: dict[str, Any] = {}
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text())
        except ValueError as error:
            raise HeadsMismatch(f"{config_path} is not JSON: {error}") from None
    medusa = sorted(folder.glob("medusa_lm_head.*"))
    if medusa:
        weights = tuple(p for p in medusa if p.suffix == ".safetensors") or tuple(medusa[:1])
    else:
        weights = tuple(sorted(folder.glob("*.safetensors"))) or tuple(
            sorted(folder.glob("*.bin")) + sorted(folder.glob("*.pt"))
        )
    if not weights:
        raise HeadsMismatch(f"{source} holds no weights (*.safetensors, *.bin, *.pt) in {folder}")
    head = PublishedHead(layout, source, folder, config, weights)
    found = _layout_of(head)
    if found != layout:
        raise HeadsMismatch(
            f"{source} is {'not a head specgen can read' if found is None else 'a ' + LAYOUT_NAMES[found] + ' head'},"
            f" not {LAYOUT_NAMES[layout]}",
            hint=f"use --draft {found}:{source}" if found else "",
        )
    if layout != "medusa" and not config:
        raise HeadsMismatch(f"{source} has no config.json")
    return head


def _layout_of(head: PublishedHead) -> str | None:
    if any(p.name.startswith("medusa_lm_head") for p in head.weights) or "medusa_num_heads" in head.config:
        return "medusa"
    shapes = head.shapes()
    fc = shapes.get("fc.weight")
    if fc is None or len(fc) != 2:
        return None
    if "draft_vocab_size" in head.layer_config or fc[1] == 3 * fc[0] or any(k.startswith("midlayer.") for k in shapes):
        return "eagle3"
    return "eagle" if fc[1] == 2 * fc[0] else None


def check_head(
    head: PublishedHead, target_config: Any, target_name: str, target_hub_id: str | None = None
) -> str | None:
    """Refuse a head whose shapes do not fit the target (HeadsMismatch, before any weights);
    return a warning when its config names another target while its shapes fit."""
    hidden, vocab, layers = target_config.hidden_size, target_config.vocab_size, target_config.num_hidden_layers
    problems: list[str] = []
    if head.layout == "medusa":
        shapes = head.shapes()
        first = shapes.get("0.0.linear.weight")
        outs = [shape for key, shape in shapes.items() if re.fullmatch(r"\d+\.\d+\.weight", key)]
        if first is None or not outs:
            raise HeadsMismatch(f"{head.source}: {head.weights[0].name} holds no Medusa heads (no 0.0.linear.weight)")
        if first[0] != hidden:
            problems.append(f"hidden size {first[0]}, the target's {hidden}")
        if outs[0][0] != vocab:
            problems.append(f"vocabulary {outs[0][0]}, the target's {vocab}")
    else:
        config = head.layer_config
        if head.layout == "eagle3":
            width = config.get("target_hidden_size") or config.get("hidden_size")
            if width != hidden or config.get("hidden_size") != hidden:
                problems.append(f"hidden size {width}, the target's {hidden}")
            features = head.feature_layers(layers)
            if max(features) >= layers or min(features) < 0:
                problems.append(f"it reads target layers {list(features)}, the target has {layers}")
        else:
            for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads"):
                mine, theirs = config.get(key), getattr(target_config, key, None)
                if mine is not None and theirs is not None and mine != theirs:
                    problems.append(f"{key.replace('_', ' ')} {mine}, the target's {theirs}")
        if config.get("vocab_size") not in (None, vocab):
            problems.append(f"vocabulary {config.get('vocab_size')}, the target's {vocab}")
    trained_for = head.base_model
    if problems:
        raise HeadsMismatch(
            f"{head.label} is for {trained_for or 'another target'}, not {target_name}: {'; '.join(problems)}",
            hint=f"give a head trained for {target_name} (specgen models --drafts-for {target_name}), or --draft auto",
        )
    if trained_for and not _same_model(trained_for, target_name, target_hub_id):
        return (
            f"{head.label} was published for {trained_for}; its shapes fit {target_name}, so it drafts for it"
            " (acceptance is only as good as the two agree)"
        )
    return None


def _same_model(trained_for: str, target_name: str, target_hub_id: str | None) -> bool:
    names = {target_name.lower().rstrip("/"), Path(target_name.rstrip("/")).name.lower()}
    if target_hub_id:
        names |= {target_hub_id.lower(), target_hub_id.split("/")[-1].lower()}
    wanted = trained_for.lower().rstrip("/")
    return wanted in names or wanted.split("/")[-1] in names
