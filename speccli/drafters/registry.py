"""The drafters `--draft NAME` selects that need no model of their own.

Adding one: a file implementing speccli.drafters.base.Drafter, and its line here
(docs/development.md shows one). A draft model, `medusa`/`eagle` heads and `none` are
resolved apart, in speccli.pipeline."""

from __future__ import annotations

from typing import Callable

from speccli.drafters.base import Drafter
from speccli.drafters.lookahead import LookaheadDrafter
from speccli.drafters.ngram import PromptLookupDrafter
from speccli.drafters.suffix import SuffixDrafter

DRAFTERS: dict[str, Callable[[], Drafter]] = {
    "ngram": PromptLookupDrafter,
    "lookahead": LookaheadDrafter,
    # Its history lives as long as the drafter (the pipeline gives it the store in the cache).
    "suffix": SuffixDrafter,
}
