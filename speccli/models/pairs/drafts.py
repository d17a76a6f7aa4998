"""Which drafts fit a target, and the one `--draft auto` takes. The registry decides: no
network, no weights.

A draft model drafts best with the target's tokenizer (another drafts by text:
speccli.drafters.cross). Models of one registry family share one; Llama 3,
3.1 and 3.2 share one tokenizer, as Qwen2.5 and Qwen2.5-Coder do (`TOKENIZER_GROUPS`).
`--draft auto` takes, for a target the registry knows (an alias, or its Hub id):

0. on CUDA, its registered published head (EAGLE-3 first, then EAGLE-1/2, then Medusa:
   `REGISTERED_HEADS`), downloaded on first use (on the CPU the choice goes on below, where
   the default target gets the offline pair, which needs no download);
1. the smallest registered model of the target's own family that is smaller than it
   (llama3-70b -> llama3-8b, qwen2.5-7b -> qwen2.5-0.5b, the default target -> the default
   draft: the offline pair);
2. else the smallest smaller model sharing its tokenizer (llama3.1-8b -> llama3.2-1b);
3. else a registered model of another tokenizer (drafting by text: speccli.drafters.cross)
   that a session with it has measured to pay on this machine (`measured`: its drafting
   steps' tokens per second against plain decoding, CROSS_DRAFT_PAYS or more);
4. else prompt lookup (`ngram`), which needs no model and never costs more than a pass.

Heads trained here (`specgen train medusa|eagle`, in the cache: `trained`) and lookahead
decoding (no download) take the place of what 1-4 chose where a session measured them paying on
this machine (CROSS_DRAFT_PAYS or more) and more than that choice measured: a draft model never
measured keeps its place, prompt lookup never measured gives way.

A target the registry does not know (a folder, a GGUF file, another Hub id) gets `ngram`:
which small model shares its tokenizer is not known without reading both. The tokenizers of
whatever draft is chosen are still compared before any weights load (speccli.models.pairs.compat).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from speccli.models.names.registry import ALIASES, Alias
from speccli.models.names.shapes import SHAPES

AUTO = "auto"
PROMPT_LOOKUP = "ngram"
LOOKAHEAD = "lookahead"
TOKENIZER_GROUPS = {
    "llama3": "llama3",
    "llama3.1": "llama3",
    "llama3.2": "llama3",
    "llama3.3": "llama3",
    "qwen2.5": "qwen2.5",
    "qwen2.5-coder": "qwen2.5",
    "smollm2": "smollm2",
}
# A draft of another tokenizer is auto's choice where it measured at least this gain over
# plain decoding on this machine: it loads a model and writes text twice a step, so it must
# clearly beat prompt lookup's free guesses.
CROSS_DRAFT_PAYS = 1.1
# Heads `specgen train` makes, saved in the cache for a target (speccli.heads.store).
TRAINED_HEAD_KINDS = ("medusa", "eagle")
HEAD_LAYOUTS = ("eagle3", "eagle", "medusa")  # the order --draft auto prefers them in
LAYOUT_NAMES = {"eagle3": "EAGLE-3", "eagle": "EAGLE-1/2", "medusa": "Medusa"}


@dataclass(frozen=True)
class RegisteredHead:
    """A published draft head for a registered target. `acceptance`: the mean tokens per
    target pass its authors published, with where (None: none quoted here)."""

    target: str  # the target's alias
    layout: str  # one of HEAD_LAYOUTS
    hub_id: str
    acceptance: str | None = None

    @property
    def draft(self) -> str:
        """What --draft takes for it."""
        return f"{self.layout}:{self.hub_id}"


def _registered_heads() -> list[RegisteredHead]:
    heads = [
        RegisteredHead(
            "llama3.1-8b",
            "eagle3",
            "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",
            "about 6 at temperature 0 on MT-bench (EAGLE-3 paper)",
        ),
        RegisteredHead("llama3.1-8b", "eagle3", "lmsys/SGLang-EAGLE3-Llama-3.1-8B-Instruct-SpecForge"),
        RegisteredHead("llama3.1-8b", "eagle3", "RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3"),
        RegisteredHead("llama3.1-8b", "eagle", "yuhuili/EAGLE-LLaMA3.1-Instruct-8B"),
        RegisteredHead("llama3.3-70b", "eagle3", "yuhuili/EAGLE3-LLaMA3.3-Instruct-70B"),
        RegisteredHead("llama3-8b", "eagle", "yuhuili/EAGLE-LLaMA3-Instruct-8B"),
        RegisteredHead("llama3-70b", "eagle", "yuhuili/EAGLE-LLaMA3-Instruct-70B"),
    ]
    for size in ("1.7B", "4B", "8B", "14B", "32B"):
        heads.append(RegisteredHead(f"qwen3-{size.lower()}", "eagle3", f"AngelSlim/Qwen3-{size}_eagle3"))
    for size in ("8B", "14B", "32B"):
        heads.append(RegisteredHead(f"qwen3-{size.lower()}", "eagle3", f"RedHatAI/Qwen3-{size}-speculator.eagle3"))
    for size in ("7b", "13b", "33b"):
        heads.append(RegisteredHead(f"vicuna-{size}", "medusa", f"FasterDecoding/medusa-vicuna-{size}-v1.3"))
    return heads


REGISTERED_HEADS: list[RegisteredHead] = _registered_heads()


def heads_for(target: str, layout: str | None = None) -> list[RegisteredHead]:
    """The registered published heads of `target` (an alias or its Hub id), in the order
    auto prefers them: EAGLE-3, then EAGLE-1/2, then Medusa; registry order within each."""
    alias = registered(target)
    if alias is None:
        return []
    found = [h for h in REGISTERED_HEADS if h.target == alias.name and layout in (None, h.layout)]
    return sorted(found, key=lambda h: HEAD_LAYOUTS.index(h.layout))


@dataclass(frozen=True)
class DraftChoice:
    """A draft for a target, and in words why."""

    name: str
    reason: str


def parameters(alias: Alias) -> float:
    """The alias's parameter count as a number ("1.5B" -> 1.5e9, "135M" -> 1.35e8)."""
    match = re.fullmatch(r"([\d.]+)([MB])", alias.params)
    if match is None:
        raise ValueError(f"alias {alias.name}: unreadable size {alias.params!r}")
    return float(match.group(1)) * (1e9 if match.group(2) == "B" else 1e6)


def registered(target: str) -> Alias | None:
    """The registry's entry for `target`: by alias, or by its Hub id."""
    key = target.strip()
    if key.lower() in ALIASES:
        return ALIASES[key.lower()]
    return next((a for a in ALIASES.values() if a.hub_id.lower() == key.lower()), None)


def draft_models_for(target: Alias) -> list[Alias]:
    """Registered models smaller than `target` sharing its tokenizer: its own family first,
    each part smallest first."""
    group = TOKENIZER_GROUPS.get(target.family, target.family)
    size = parameters(target)
    smaller = [
        a for a in ALIASES.values() if TOKENIZER_GROUPS.get(a.family, a.family) == group and parameters(a) < size
    ]
    return sorted(smaller, key=lambda a: (a.family != target.family, parameters(a), a.name))


def other_tokenizer_drafts(target: Alias) -> list[Alias]:
    """Registered models smaller than `target` with another tokenizer: the smallest of each
    tokenizer, smallest first (they draft by text)."""
    group = TOKENIZER_GROUPS.get(target.family, target.family)
    size = parameters(target)
    smallest: dict[str, Alias] = {}
    for alias in sorted(ALIASES.values(), key=lambda a: (parameters(a), a.name)):
        other = TOKENIZER_GROUPS.get(alias.family, alias.family)
        if other != group and parameters(alias) < size:
            smallest.setdefault(other, alias)
    return sorted(smallest.values(), key=lambda a: (parameters(a), a.name))


def trained_heads(target: str, cache_dir: Path | None = None) -> list[str]:
    """The kinds of heads `specgen train` saved for `target` in the cache."""
    from speccli.models.names import offline

    cache = Path(cache_dir) if cache_dir is not None else offline.default_cache_dir()
    alias = registered(target)
    name = alias.name if alias else target
    return [kind for kind in TRAINED_HEAD_KINDS if offline.default_heads_path(cache, name, kind).is_file()]


def choose_draft(
    target: str,
    cuda: bool = False,
    measured: Mapping[str, float] | None = None,
    trained: Sequence[str] = (),
) -> DraftChoice:
    """What `--draft auto` takes for `target` (see the module's docstring); on CUDA a
    registered published head comes first. `measured`: drafts' measured gains over plain
    decoding for this target on this machine (speccli.calibration.measured_draft_gains);
    `trained`: the kinds of heads trained here for it (`trained_heads`)."""
    heads = heads_for(target) if cuda else []
    if heads:
        alias = registered(target)
        assert alias is not None  # heads_for finds heads only for a registered target
        return DraftChoice(
            heads[0].draft,
            f"the registered {LAYOUT_NAMES[heads[0].layout]} head of {alias.name},"
            " trained by its publisher on chat data",
        )
    return _measured_more(_choose_model(target, measured or {}), trained, measured or {})


def _measured_more(choice: DraftChoice, trained: Sequence[str], gains: Mapping[str, float]) -> DraftChoice:
    """Heads trained here, or lookahead decoding, in place of `choice` where a session measured
    them paying here, and more than `choice` measured (prompt lookup unmeasured counts as paying
    less: lookahead and heads are never below it by much; a draft model unmeasured keeps its place)."""
    paying = [(gains[name], name) for name in (*trained, LOOKAHEAD) if gains.get(name, 0.0) >= CROSS_DRAFT_PAYS]
    if not paying:
        return choice
    gain, name = max(paying)
    what = f"the {name} heads trained here" if name in TRAINED_HEAD_KINDS else "lookahead decoding"
    other = gains.get(choice.name)
    if other is None and choice.name == PROMPT_LOOKUP:
        return DraftChoice(name, f"{what} measured {gain:.2f}x plain decoding's rate here")
    if other is None or other >= gain:
        return choice
    return DraftChoice(name, f"{what} measured {gain:.2f}x plain decoding's rate here ({choice.name}: {other:.2f}x)")


def _choose_model(target: str, measured: Mapping[str, float]) -> DraftChoice:
    """Steps 1-4 of the module's docstring: a draft model, or prompt lookup."""
    alias = registered(target)
    if alias is None:  # and so no registered heads either
        return DraftChoice(
            PROMPT_LOOKUP,
            f"{target} is not in specgen's registry, so no draft model is known to share"
            " its tokenizer: prompt lookup (give --draft MODEL to use one)",
        )
    candidates = draft_models_for(alias)
    if not candidates:
        gains = measured
        paying = [
            (gains[a.name], a.name) for a in other_tokenizer_drafts(alias) if gains.get(a.name, 0.0) >= CROSS_DRAFT_PAYS
        ]
        if paying:
            gain, name = max(paying)
            return DraftChoice(
                name,
                f"no registered model shares {alias.name}'s tokenizer; {name} (another tokenizer, drafting by"
                f" text) measured {gain:.2f}x plain decoding's rate here",
            )
        return DraftChoice(
            PROMPT_LOOKUP, f"no registered model is smaller than {alias.name} with its tokenizer: prompt lookup"
        )
    best = candidates[0]
    kind = "of its family" if best.family == alias.family else "with its tokenizer"
    return DraftChoice(best.name, f"the smallest registered model {kind} ({best.params})")


@dataclass(frozen=True)
class DraftOption:
    """One line of `specgen models --drafts-for`."""

    name: str
    kind: str  # "published head", "model", "heads", "drafter"
    about: str
    auto: bool = False  # what --draft auto takes on the CPU
    auto_cuda: bool = False  # and on CUDA


def drafts_for(
    target: str,
    cache_dir: Path | None = None,
    measured: Mapping[str, float] | None = None,
    shares: Mapping[str, float | None] | None = None,
) -> list[DraftOption]:
    """Every draft that can serve `target`: published heads registered for it, registered
    models sharing its tokenizer, the smallest registered models of other tokenizers
    (drafting by text; `shares`: the share of the target's vocabulary each spells alike,
    where both tokenizers are on this machine), heads trained here for it, and the drafters
    that need no model; the ones auto takes on the CPU and on CUDA marked (`measured`: as
    choose_draft takes it)."""
    from speccli.models.names.offline import default_heads_path
    from speccli.models.names import offline

    trained = trained_heads(target, cache_dir)
    chosen = choose_draft(target, measured=measured, trained=trained).name
    chosen_cuda = choose_draft(target, cuda=True, measured=measured, trained=trained).name
    options: list[DraftOption] = []
    alias = registered(target)
    for head in heads_for(target):
        assert alias is not None  # heads_for finds heads only for a registered target
        acceptance = f"published acceptance {head.acceptance}" if head.acceptance else "no published acceptance quoted"
        if head.layout == "medusa":
            size = "a residual block and an output layer per guessed position"
        else:
            size = f"one decoder layer, about 1/{SHAPES[alias.hub_id]['num_hidden_layers']} of the target's"
        options.append(
            DraftOption(
                head.draft,
                "published head",
                f"{LAYOUT_NAMES[head.layout]} head ({size}; {acceptance}); downloaded on first use",
                head.draft == chosen,
                head.draft == chosen_cuda,
            )
        )
    if alias is not None:
        for model in draft_models_for(alias):
            how = "same family" if model.family == alias.family else "same tokenizer"
            options.append(
                DraftOption(
                    model.name,
                    "model",
                    f"{model.description}, {model.params} ({how})",
                    model.name == chosen,
                    model.name == chosen_cuda,
                )
            )
        for model in other_tokenizer_drafts(alias):
            share = (shares or {}).get(model.name)
            spelled = (
                f"{share:.0%} of the target's tokens spelled alike"
                if share is not None
                else "vocabulary share known once both tokenizers are on this machine"
            )
            seen = _measured_note(measured, model.name)
            options.append(
                DraftOption(
                    model.name,
                    "model (other tokenizer)",
                    f"{model.description}, {model.params}: drafts by text ({spelled}{seen})",
                    model.name == chosen,
                    model.name == chosen_cuda,
                )
            )
    cache = Path(cache_dir) if cache_dir is not None else offline.default_cache_dir()
    for kind in trained:
        path = default_heads_path(cache, alias.name if alias else target, kind)
        seen = _measured_note(measured, kind)
        options.append(
            DraftOption(kind, "heads", f"{kind} heads trained here ({path}{seen})", kind == chosen, kind == chosen_cuda)
        )
    options.append(
        DraftOption(
            PROMPT_LOOKUP,
            "drafter",
            "prompt lookup: continuations copied from the text so far",
            chosen == PROMPT_LOOKUP,
            chosen_cuda == PROMPT_LOOKUP,
        )
    )
    options.append(
        DraftOption(
            "suffix",
            "drafter",
            "suffix drafting: continuations of the text so far and of earlier prompts and answers (kept in the cache;"
            " under auto beside a model or head, taking turns with it, kept in memory)",
            chosen not in (PROMPT_LOOKUP, LOOKAHEAD),
            chosen_cuda not in (PROMPT_LOOKUP, LOOKAHEAD),
        )
    )
    options.append(
        DraftOption(
            LOOKAHEAD,
            "drafter",
            f"lookahead decoding: n-grams the target's own passes propose{_measured_note(measured, LOOKAHEAD)}",
            chosen == LOOKAHEAD,
            chosen_cuda == LOOKAHEAD,
        )
    )
    return options


def _measured_note(measured: Mapping[str, float] | None, name: str) -> str:
    """ "; measured 1.30x plain here" where a session measured `name` here, else nothing."""
    gain = (measured or {}).get(name)
    return f"; measured {gain:.2f}x plain here" if gain is not None else ""
