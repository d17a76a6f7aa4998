"""Wiring between loaded models and the engine: a target and a draft choice loaded, checked
and put behind one decoder, and the Generator every surface generates through."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from speccli.config import LoadConfig
from speccli.engine.backends import HFCausalLM
from speccli.engine.decoder import SpeculativeDecoder
from speccli.engine.drafters import DEFAULT_STOP_CONFIDENCE, Drafter, ModelDrafter, PromptLookupDrafter
from speccli.models.compat import check_tokenizers_compatible
from speccli.models.loading import LoadedModel, dtype_name, load_model

if TYPE_CHECKING:  # pragma: no cover
    from speccli.generation.stream import Generator

NGRAM_DRAFT = "ngram"
NO_DRAFT = "none"


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
        """The draft model's name, or the drafter's (`ngram`, `none`) when there is no model."""
        return self.draft.name if self.draft else self.drafter_name

    def generator(self, progress: Callable[[str], None] | None = None, recalibrate: bool = False) -> Generator:
        """The Generator over this pipeline's decoder. `k auto` calibrates through the
        on-disk cache (speccli.generation.calibration) the first time it is asked for."""
        from speccli.generation.calibration import calibrate
        from speccli.generation.stream import Generator

        return Generator(self.decoder, lambda max_k: calibrate(self, max_k, progress, refresh=recalibrate))

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
        }


def load_pipeline(
    target_name: str,
    draft_name: str,
    target_config: LoadConfig,
    draft_config: LoadConfig,
    progress: Callable[[str], None] | None = None,
) -> Pipeline:
    """Load the target and (unless the draft is `ngram` or `none`) the draft model,
    refuse tokenizers that disagree, and build the decoder."""
    target = load_model(target_name, target_config, progress=progress)
    target_lm = HFCausalLM(target.model)
    draft: LoadedModel | None = None
    drafter: Drafter | None
    key = draft_name.strip().lower()
    if key == NGRAM_DRAFT:
        drafter = PromptLookupDrafter()
    elif key == NO_DRAFT:
        drafter = None
    else:
        draft = load_model(draft_name, draft_config, progress=progress)
        check_tokenizers_compatible(target.tokenizer, draft.tokenizer)
        drafter = ModelDrafter(HFCausalLM(draft.model), target_lm.vocab_size, DEFAULT_STOP_CONFIDENCE)
    decoder = SpeculativeDecoder(target_lm, target.tokenizer, target.eos_token_ids, drafter)
    return Pipeline(target, draft, drafter.name if drafter else NO_DRAFT, decoder)
