"""Can this draft propose tokens for that target?

Speculative decoding hands the draft's token ids straight to the target, so every id
both tokenizers know must mean the same token string, and the special tokens must
agree. One tokenizer may know more ids than the other (tokens appended at the end),
and the models' embedding matrices may be padded to different sizes: the draft then
proposes, and is fed, only the ids both know (:func:`shared_vocab`; the drafter
aligns the logits, see ``drafters.base.align_vocab``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from speccli.models.errors import TokenizerMismatchError

__all__ = ["SharedVocab", "check_tokenizers_compatible", "shared_vocab"]

SPECIAL_TOKENS = ("bos", "eos", "pad", "unk")

_HINT = (
    "use --draft auto, ngram, or a draft of the target's family (same tokenizer);"
    " `specgen models --drafts-for TARGET` lists them"
)


def _id_to_token(tokenizer: Any, size: int) -> list[str | None]:
    """Token string of each id below ``size`` (None for ids the tokenizer does not define)."""
    table: list[str | None] = [None] * size
    for token, index in tokenizer.get_vocab().items():
        if 0 <= index < size:
            table[index] = token
    return table


def _vocabulary_kind(tokenizer: Any) -> str | None:
    """BPE, Unigram, WordPiece... where the tokenizer says (a fast tokenizer's model)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return type(backend.model).__name__ if backend is not None else None


def _added_around_text(tokenizer: Any) -> list[int] | None:
    """The ids a tokenizer adds around any text (its BOS/EOS handling), None where it cannot say."""
    try:
        return list(tokenizer("", add_special_tokens=True)["input_ids"])
    except Exception:  # noqa: BLE001 - not a callable tokenizer: nothing to compare
        return None


def check_tokenizers_compatible(target_tok: Any, draft_tok: Any) -> None:
    """Raise :class:`TokenizerMismatchError` unless the draft's ids mean what the target's do.

    As llama.cpp's `common_speculative_are_compatible` asks, from the tokenizer files alone:
    the same kind of vocabulary, the same special tokens added around a text, and the same
    token text for every id below ``min(len(target), len(draft))`` (here from id 0, so the
    special tokens too); the bos/eos/pad/unk tokens (string and id) wherever both define
    one. Unlike llama.cpp, a draft whose vocabulary is a prefix of the target's (or the
    reverse) passes however many ids one lacks: the draft proposes only the shared ones.
    """
    kinds = _vocabulary_kind(target_tok), _vocabulary_kind(draft_tok)
    if None not in kinds and kinds[0] != kinds[1]:
        raise TokenizerMismatchError(
            f"tokenizers are of different kinds: target {kinds[0]} vs draft {kinds[1]}", hint=_HINT
        )
    added = _added_around_text(target_tok), _added_around_text(draft_tok)
    if None not in added and added[0] != added[1]:
        raise TokenizerMismatchError(
            f"tokenizers add different special tokens around a text: target {added[0]} vs draft {added[1]}",
            hint=_HINT,
        )
    size = min(len(target_tok), len(draft_tok))
    target_ids = _id_to_token(target_tok, size)
    draft_ids = _id_to_token(draft_tok, size)
    if target_ids != draft_ids:
        first = next(i for i, (a, b) in enumerate(zip(target_ids, draft_ids)) if a != b)
        differing = sum(a != b for a, b in zip(target_ids, draft_ids))
        more = f" ({differing} of {size} shared ids differ)" if differing > 1 else ""
        raise TokenizerMismatchError(
            f"tokenizers differ at id {first}: target {_show(target_ids[first])} vs draft "
            f"{_show(draft_ids[first])}{more}",
            hint=_HINT,
        )

    for kind in SPECIAL_TOKENS:
        t_tok, d_tok = getattr(target_tok, f"{kind}_token", None), getattr(draft_tok, f"{kind}_token", None)
        t_id, d_id = getattr(target_tok, f"{kind}_token_id", None), getattr(draft_tok, f"{kind}_token_id", None)
        if t_tok is None or d_tok is None:
            continue
        if str(t_tok) != str(d_tok) or t_id != d_id:
            raise TokenizerMismatchError(
                f"tokenizers' {kind} tokens differ: target {_show(str(t_tok))} (id {t_id}) vs "
                f"draft {_show(str(d_tok))} (id {d_id})",
                hint=_HINT,
            )


@dataclass(frozen=True)
class SharedVocab:
    """What a draft may propose and be fed: the ids below ``size``, which both tokenizers
    know; any other id reaches the draft as ``substitute_id`` (its unk token, else 0)."""

    size: int
    substitute_id: int


def shared_vocab(target_tok: Any, draft_tok: Any) -> SharedVocab:
    """The ids a compatible draft shares with its target (see :class:`SharedVocab`)."""
    size = min(len(target_tok), len(draft_tok))
    unk = getattr(draft_tok, "unk_token_id", None)
    return SharedVocab(size, unk if isinstance(unk, int) and 0 <= unk < size else 0)


def _show(token: str | None) -> str:
    return "(no token)" if token is None else repr(token)
