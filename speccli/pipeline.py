"""Wiring between loaded models and the engine: a target and a draft choice loaded, checked
and put behind one decoder, and the Speculator every surface generates through."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from speccli.backends.base import CausalLM, FeatureLM
from speccli.backends.hf import HFCausalLM
from speccli.backends.llamacpp import LlamaCppLM
from speccli.backends.static import StaticCausalLM, static_cache_problem
from speccli.config import LoadConfig
from speccli.drafters.base import Drafter
from speccli.drafters.candidates import CandidateDrafter
from speccli.drafters.cross import CrossVocabDrafter
from speccli.drafters.model import DEFAULT_STOP_CONFIDENCE, ModelDrafter
from speccli.drafters.registry import DRAFTERS
from speccli.drafters.suffix import HISTORY_TOKENS, SuffixHistory
from speccli.loop import SpeculativeDecoder, features_of
from speccli.models.errors import ModelLoadError, TokenizerMismatchError
from speccli.models.pairs.compat import check_tokenizers_compatible, shared_vocab
from speccli.drafters.vocab_bridge import VocabBridge, bridge_vocabularies
from speccli.models.pairs.drafts import AUTO as AUTO_DRAFT
from speccli.models.pairs.drafts import choose_draft, trained_heads
from speccli.models.loading import (
    LoadedModel,
    PendingModel,
    choose_device,
    dtype_name,
    load_tokenizer,
    load_weights,
    model_config,
)
from speccli.models.memory.plan import check_pair_fits
from speccli.models.names import offline

if TYPE_CHECKING:  # pragma: no cover
    from speccli.api import Speculator
    from speccli.models.pairs.published_heads import PublishedHead

NO_DRAFT = "none"
HEAD_DRAFTS = ("medusa", "eagle", "eagle3")


@dataclass(frozen=True)
class HeadDraft:
    """`--draft medusa|eagle|eagle3[:SOURCE]`: heads `specgen train` saved (the default place,
    or a heads file), or a published head (a folder or a Hub id; `eagle3` alone: the head the
    registry has for the target)."""

    kind: str
    source: str | None = None

    @property
    def published(self) -> bool:
        if self.kind == "eagle3":
            return True
        return self.source is not None and not Path(self.source).expanduser().is_file()

    @property
    def path(self) -> Path | None:
        """The heads file `specgen train` wrote, for heads of its own."""
        return None if self.published or self.source is None else Path(self.source).expanduser()


def head_draft(name: str) -> HeadDraft | None:
    """The heads `name` asks for; None for any other draft."""
    kind, colon, source = name.strip().partition(":")
    if kind.lower() not in HEAD_DRAFTS or (colon and not source):
        return None
    return HeadDraft(kind.lower(), source or None)


@dataclass
class Pipeline:
    """A loaded target, its drafter, and the decoder over them."""

    target: LoadedModel
    draft: LoadedModel | None
    drafter_name: str
    decoder: SpeculativeDecoder

    @property
    def tokenizer(self):
        return self.target.tokenizer

    @property
    def draft_label(self) -> str:
        """The draft model's name, or the drafter's (`ngram`, `lookahead`, `none`) when there is no model."""
        return self.draft.name if self.draft else self.drafter_name

    def speculator(self, progress: Callable[[str], None] | None = None, recalibrate: bool = False) -> Speculator:
        """The Speculator over this pipeline's decoder. `k auto` calibrates through the
        on-disk cache (speccli.calibration) the first time it is asked for, and
        what it learns about the draft's acceptance is kept there after each generation, with
        the passes it ran while the calibration is still filling in; a complete calibration
        the generation's own passes show overstated is dropped, to be measured again."""
        from speccli.api import Speculator
        from speccli.calibration import calibrate, drop_if_overstated, refine, remember

        def after_generation(decoder: SpeculativeDecoder, max_k: int) -> str | None:
            remember(self, max_k, decoder=decoder)
            if refine(self, max_k, decoder=decoder):  # a table still filling in takes the passes
                return None
            return drop_if_overstated(self, max_k, decoder=decoder)

        return Speculator(
            self.decoder,
            lambda max_k: calibrate(self, max_k, progress, refresh=recalibrate),
            after_generation,
            notify=progress,
        )

    def model_info(self) -> dict[str, str]:
        """What ran, for saved sessions and benchmark reports."""
        return {
            "target": self.target.name,
            "draft": self.draft_label,
            "drafter": self.drafter_name,
            "dtype": dtype_name(self.target.dtype),
            "device": str(self.target.device),
            "quant": self.target.quant,
            "draft_quant": self.draft.quant if self.draft else "none",
            "linear": self.target.linear,
            "backend": backend_label(self.decoder.target),
        }


# What may follow '+' in --draft: lookahead is prompt lookup's steps with a window of its own.
TAKE_TURNS = ("ngram", "suffix")
# What takes turns with the draft model or heads that --draft auto picks: suffix drafting, its
# history kept in memory only (a chat's turns, a server's requests), not in the cache's store.
AUTO_TAKES_TURNS = ("suffix",)


def split_candidates(draft_name: str) -> tuple[str, list[str]]:
    """`--draft A+B+C`: the draft A, then drafters that need no model (DRAFTERS) taking turns
    with it, each step drafted by the one k auto expects the most of. A name whose parts after
    '+' are not all such drafters is refused, unless it is a path that exists."""
    first, *rest = draft_name.split("+")
    if not rest or Path(draft_name).expanduser().exists():
        return draft_name, []
    also = [part.strip().lower() for part in rest]
    unknown = [part for part in also if part not in TAKE_TURNS]
    if unknown or len(set(also)) != len(also):
        raise ModelLoadError(
            f"--draft {draft_name}: after '+' come drafters that need no model and take turns, each once",
            hint=f"one of: {', '.join(TAKE_TURNS)} (e.g. --draft auto+ngram)",
        )
    if first.strip().lower() in (*DRAFTERS, NO_DRAFT):
        raise ModelLoadError(
            f"--draft {draft_name}: before '+' comes a draft model or heads",
            hint="e.g. --draft auto+ngram, or --draft ngram alone",
        )
    return first.strip(), also


def load_pipeline(
    target_name: str,
    draft_name: str,
    target_config: LoadConfig,
    draft_config: LoadConfig,
    progress: Callable[[str], None] | None = None,
) -> Pipeline:
    """Load the target and (unless the draft is one of DRAFTERS, heads or `none`) the draft model,
    refuse tokenizers that disagree, and build the decoder.

    Both tokenizers are loaded and compared before any weights, so that a mismatched
    draft is refused in seconds."""
    draft_name, also = split_candidates(draft_name)
    auto = draft_name.strip().lower() == AUTO_DRAFT
    if auto:
        from speccli.calibration import measured_draft_gains

        device = choose_device(target_config.device)
        measured = measured_draft_gains(target_name, device=device)
        trained = trained_heads(target_name)
        choice = choose_draft(target_name, cuda=device.type == "cuda", measured=measured, trained=trained)
        if progress is not None:
            progress(f"draft: {choice.name} (--draft auto: {choice.reason})")
        draft_name = choice.name
    key = draft_name.strip().lower()
    heads = head_draft(draft_name)
    if heads is not None:
        target_config = _transformers_for_heads(target_config, heads.kind)
    pending_target = load_tokenizer(target_name, target_config, progress=progress)
    published = None
    if heads is not None and heads.published:
        from speccli.models.pairs.published_heads import HeadUnavailable

        try:
            published = _published_head(heads, pending_target, progress)
        except HeadUnavailable as error:
            if not auto:
                raise
            # What auto takes without a head: the choice it makes where heads are not first.
            fallback = choose_draft(target_name)
            if progress is not None:
                progress(f"draft: {fallback.name} instead ({error}): {fallback.reason}")
            draft_name, key, heads = fallback.name, fallback.name.lower(), None
    pending_draft = None
    bridge: VocabBridge | None = None
    if key not in DRAFTERS and key != NO_DRAFT and heads is None:
        pending_draft = load_tokenizer(draft_name, draft_config, progress=progress)
        bridge = vocab_bridge(pending_target.tokenizer, pending_draft.tokenizer, pending_draft.name, progress)
        _check_pair_memory(pending_target, pending_draft)

    target = load_weights(pending_target, progress)
    target_lm = causal_lm(target, target_config.cuda_graphs, target_config.compile)
    if target_config.tp > 1:
        from speccli.backends.distributed import lead

        target_lm = lead(features_of(target_lm))  # the other ranks run each of its passes on their shards
    draft: LoadedModel | None = None
    drafter: Drafter | None
    if key in DRAFTERS:
        drafter = named_drafter(key, target, target_config)
    elif published is not None:
        from speccli.models.pairs.published_drafter import published_drafter

        drafter = published_drafter(published, features_of(target_lm), target.model.config)
    elif heads is not None:
        drafter = head_drafter(target, features_of(target_lm), heads.kind, heads.path, progress=progress)
    elif pending_draft is None:
        drafter = None
    else:
        draft = load_weights(pending_draft, progress)
        drafter = model_drafter(
            target_lm,
            target.tokenizer,
            draft,
            cuda_graphs=draft_config.cuda_graphs,
            compile=draft_config.compile,
            bridge=bridge,
        )
    stored = True  # suffix drafting's history in the cache's store, as named
    if auto and not also and drafter is not None and key not in DRAFTERS:
        also, stored = (
            list(AUTO_TAKES_TURNS),
            False,
        )  # a draft model or heads, with suffix drafting where it promises more
        if progress is not None:
            progress(f"draft: {draft_name} and {', '.join(also)}, each step the one k auto expects more of")
    if also:
        if drafter is None:
            raise ModelLoadError("--draft none cannot take turns with other drafters", hint="give a draft before '+'")
        drafter = CandidateDrafter([drafter, *(named_drafter(name, target, target_config, stored) for name in also)])
    decoder = SpeculativeDecoder(target_lm, target.tokenizer, target.eos_token_ids, drafter)
    return Pipeline(target, draft, drafter.name if drafter else NO_DRAFT, decoder)


def _published_head(heads: HeadDraft, target: PendingModel, progress: Callable[[str], None] | None) -> PublishedHead:
    """The published head `heads` names, read as far as its config and checked against the
    target's config: a head for another target is refused before any weights load."""
    from speccli.models.pairs.drafts import heads_for, registered
    from speccli.models.errors import HeadsMismatch
    from speccli.models.pairs.published_heads import check_head, read_head

    source = heads.source
    if source is None:
        found = heads_for(target.name, heads.kind)
        if not found:
            raise HeadsMismatch(
                f"no published {heads.kind} head is registered for {target.name}",
                hint=f"give one: --draft {heads.kind}:HUB_ID|FOLDER  (see specgen models --drafts-for {target.name})",
            )
        source = found[0].hub_id
    head = read_head(source, heads.kind, progress)
    alias = registered(target.name)
    warning = check_head(head, model_config(target), target.name, alias.hub_id if alias else None)
    if progress is not None:
        progress(f"draft: {head.label}")
        if warning:
            progress(f"warning: {warning}")
    return head


def named_drafter(name: str, target: LoadedModel, config: LoadConfig, stored: bool = True) -> Drafter:
    """The drafter `--draft NAME` names that needs no model of its own; suffix drafting's
    history kept in specgen's cache for the target where `stored`, unless the cache is off
    (--no-cache)."""
    if name != "suffix":
        return DRAFTERS[name]()
    from speccli.drafters.suffix import SuffixDrafter
    from speccli.models.formats import converted

    if not stored or not config.keep_converted or converted.disabled_by_environment():
        return SuffixDrafter()
    store = offline.default_cache_dir() / "suffix" / f"{offline.slug(target.name)}.json"
    return SuffixDrafter(stored_suffix_history(store, f"{target.name} {len(target.tokenizer)}"))


SUFFIX_STORE_FORMAT = 1


def stored_suffix_history(store: Path, identity: str, max_tokens: int = HISTORY_TOKENS) -> SuffixHistory:
    """Suffix drafting's history read from `store` (its texts only where the store was written
    for the same `identity`: the target and its tokenizer) and written back after each text,
    whole or not at all; a missing, damaged or read-only store only costs what it would save."""
    data = offline.read_json_object(store)
    texts: list[list[int]] = []
    if data.get("format") == SUFFIX_STORE_FORMAT and data.get("identity") == identity:
        try:
            texts = [[int(t) for t in text] for text in data["texts"]]
        except (KeyError, TypeError, ValueError):
            texts = []

    def save(history: SuffixHistory) -> None:
        payload = {"format": SUFFIX_STORE_FORMAT, "identity": identity, "texts": history.texts}
        offline.write_json(store, payload, indent=None)

    return SuffixHistory(max_tokens, texts, on_add=save)


def vocab_bridge(
    target_tokenizer: Any, draft_tokenizer: Any, draft_name: str, progress: Callable[[str], None] | None = None
) -> VocabBridge | None:
    """None where the draft shares the target's tokenizer; else the bridge between the two
    (a draft of another family), or CannotBridge saying why none can work."""
    try:
        check_tokenizers_compatible(target_tokenizer, draft_tokenizer)
        return None
    except TokenizerMismatchError as mismatch:
        bridge = bridge_vocabularies(target_tokenizer, draft_tokenizer)
        if progress is not None:
            progress(
                f"draft: {draft_name} has another tokenizer ({mismatch.message}): it drafts by text;"
                f" {bridge.shared:,} of its tokens are the target's ({bridge.share_of_target():.0%} of the"
                " target's vocabulary), which it drafts from when sampling"
            )
        return bridge


def _check_pair_memory(target: PendingModel, draft: PendingModel) -> None:
    """Before any weights: a target and draft sharing a GPU must fit it together."""
    if target.memory is None or draft.memory is None or target.device != draft.device:
        return
    free, _ = torch.cuda.mem_get_info(target.device)
    check_pair_fits(target.name, target.memory, draft.name, draft.memory, free, str(target.device))


def _transformers_for_heads(config: LoadConfig, kind: str) -> LoadConfig:
    """Heads read the target's hidden states, which only the transformers backends hand out."""
    from speccli.models.errors import ModelLoadError

    if config.backend == "llama.cpp":
        raise ModelLoadError(
            f"{kind} heads read the target's hidden states, which the llama.cpp backend does not hand out",
            hint="use --backend transformers (or auto) with --draft medusa/eagle",
        )
    return replace(config, backend="transformers")


def uses_cuda_graphs(loaded: LoadedModel, cuda_graphs: str = "auto") -> bool:
    """Whether `cuda_graphs` (auto/off) puts this model on the static-cache backend with CUDA
    graphs: auto does on CUDA for bfloat16/float16 weights and bitsandbytes 4/8-bit models, when
    the model's layers are all full attention over sdpa or eager attention. A model on the CPU
    never does: there transformers' DynamicCache is what runs fastest."""
    if cuda_graphs == "off" or torch.device(loaded.device).type != "cuda":
        return False
    if loaded.quant not in ("4bit", "8bit") and loaded.dtype not in (torch.bfloat16, torch.float16):
        return False
    return static_cache_problem(loaded.model) is None


def causal_lm(loaded: LoadedModel, cuda_graphs: str = "auto", compile: str = "auto") -> CausalLM:
    """The backend a loaded model decodes through: llama.cpp for a model loaded by it, else
    transformers: the static cache with CUDA graphs (see `uses_cuda_graphs`) or with
    `compile` on, else the DynamicCache. `compile` on where it cannot apply is a ModelLoadError."""
    compiled = compile == "on"
    if loaded.backend == "llama.cpp":
        if compiled:
            _cannot_compile(loaded, "it runs through llama.cpp", "--backend transformers")
        return LlamaCppLM(loaded.model)
    graphs = uses_cuda_graphs(loaded, cuda_graphs)
    if compiled:
        problem = static_cache_problem(loaded.model)
        if problem is not None:
            _cannot_compile(loaded, f"the static KV cache cannot serve it ({problem})", "--compile off")
        keep_compiled_kernels()
    if graphs or compiled:
        return StaticCausalLM(loaded.model, graphs=graphs, compile=compiled)
    return HFCausalLM(loaded.model)


def _cannot_compile(loaded: LoadedModel, why: str, hint: str) -> None:
    from speccli.models.errors import ModelLoadError

    raise ModelLoadError(f"--compile on cannot apply to {loaded.name}: {why}", hint=f"use {hint}")


def keep_compiled_kernels() -> None:
    """Point inductor's on-disk cache at specgen's cache, where it outlives /tmp: a later
    start reads the compiled passes back. A TORCHINDUCTOR_CACHE_DIR the user set is kept;
    torch sets its /tmp default there itself the first time anything asks for it."""
    import os

    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        torch_default = default_cache_dir()
    except ImportError:  # an older torch: it sets no default before it compiles
        torch_default = None
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, torch_default):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(offline.default_cache_dir() / "inductor")


def backend_label(lm: CausalLM) -> str:
    """llama.cpp, dynamic-cache, static-cache or static-cache+cuda-graphs, with +compile where
    the passes run compiled (for reports)."""
    from speccli.backends.distributed import LeaderLM, current

    if isinstance(lm, LeaderLM):
        return f"{backend_label(lm.wrapped)}+tp{current().size}"
    if isinstance(lm, LlamaCppLM):
        return "llama.cpp"
    if isinstance(lm, StaticCausalLM):
        label = "static-cache+cuda-graphs" if lm.graphs_enabled else "static-cache"
        return label + "+compile" if lm.compile_enabled else label
    return "dynamic-cache"


def model_drafter(
    target_lm: CausalLM,
    target_tokenizer: Any,
    draft: LoadedModel,
    stop_confidence: float = DEFAULT_STOP_CONFIDENCE,
    cuda_graphs: str = "auto",
    compile: str = "auto",
    bridge: VocabBridge | None = None,
) -> ModelDrafter | CrossVocabDrafter:
    """A drafter over ``draft`` for that target: with `bridge` (a draft of another tokenizer,
    see `vocab_bridge`), one that drafts by text; else one proposing only the ids both
    tokenizers know (the tokenizers must have passed ``check_tokenizers_compatible``)."""
    if bridge is not None:
        return CrossVocabDrafter(causal_lm(draft, cuda_graphs, compile), bridge, target_lm.vocab_size, stop_confidence)
    shared = shared_vocab(target_tokenizer, draft.tokenizer)
    return ModelDrafter(
        causal_lm(draft, cuda_graphs, compile),
        target_lm.vocab_size,
        stop_confidence,
        shared_vocab=shared.size,
        substitute_id=shared.substitute_id,
    )


def head_drafter(
    target: LoadedModel,
    target_lm: FeatureLM,
    kind: str,
    path: Path | None = None,
    progress: Callable[[str], None] | None = None,
) -> Drafter:
    """A Medusa or EAGLE drafter for the loaded target (decoding through `target_lm`, which
    hands out its embedding and output rows whole), from `path` or from where `specgen
    train` saves heads for it. Heads trained for another target are refused (HeadsMismatch)."""
    from speccli.drafters.eagle_layer import OutputRows
    from speccli.drafters.heads import EagleDrafter, MedusaDrafter
    from speccli.drafters.medusa_heads import MedusaHeads
    from speccli.heads.store import HeadsMismatch, load_heads
    from speccli.models.names.offline import default_heads_path

    if path is None:
        path = default_heads_path(offline.default_cache_dir(), target.name, kind)
        if not path.is_file():
            raise HeadsMismatch(
                f"no {kind} heads trained for {target.name} (looked in {path})",
                hint=f"train them: specgen train {kind} --target {target.name}   (or give --draft {kind}:PATH)",
            )
    rows = target_lm.output_rows()
    heads = load_heads(path, target.model, target.name, kind, rows)
    if progress is not None:
        accuracy = heads.training.get("accuracy") or []
        shown = ", ".join(f"{100 * a:.0f}%" for a in accuracy) or "not measured"
        progress(
            f"{kind} heads from {path} (trained on {heads.training.get('tokens', '?')} tokens; held-out top-1 {shown})"
        )
    embeddings = target_lm.input_embedding()
    weight = embeddings.weight
    assert isinstance(weight, torch.Tensor)
    dtype = weight.dtype if weight.dtype.is_floating_point else torch.float32
    module = heads.module.to(weight.device)
    if isinstance(module, MedusaHeads):
        return MedusaDrafter(module, heads.vocab, dtype)
    rows = rows[heads.vocab.ids.to(weight.device)]
    return EagleDrafter(module, heads.vocab, embeddings, OutputRows(rows), DEFAULT_STOP_CONFIDENCE, dtype)
