"""How a text meets a model's context: the one rule for every reader of a user's text (`ffkv
explain`, the web explorer through `ffkv.web.explain`), and for a corpus's sentences
(`fit_sentences`: cut at the end, said aloud, never refused).

A text longer than the limit is refused (FfkvError, one line), never cut silently. Only an
explicit `truncate` cuts it: "left" drops tokens from the start and keeps the end (the prediction
after the text's last token is still explained), "right" keeps the start and drops the end (as
Hugging Face tokenizers' `truncation_side` names the sides). The caller says the cut aloud: on
stderr and in its JSON (`truncated: {side, dropped_tokens}`).
"""
from __future__ import annotations

from ffkv.errors import FfkvError

TRUNCATE_SIDES = ("left", "right")
TRUNCATE_HINT = "; shorten it, or pass --truncate left (keep its end) or --truncate right (keep its start)"


def check_truncate(truncate: str | None) -> str | None:
    """None (refuse what does not fit), "left" or "right"; anything else is FfkvError."""
    if truncate in (None, ""):
        return None
    if truncate not in TRUNCATE_SIDES:
        raise FfkvError(f"--truncate {truncate!r}: choose left (keep the end) or right (keep the start)")
    return truncate


def fit_context(ids: list[int], max_len: int, truncate: str | None = None,
                limit: str = "the model's context", hint: str = TRUNCATE_HINT) -> tuple[list[int], int]:
    """(ids, dropped): `ids` as they fit in `max_len` tokens, and how many were dropped.

    Longer than `max_len`: FfkvError naming the length and `limit` (ending with `hint`) unless
    `truncate` is "left" or "right", which keep the last or the first `max_len` tokens."""
    truncate = check_truncate(truncate)
    if max_len < 1:
        raise FfkvError(f"{limit} holds no token")
    ids = list(ids)
    n = len(ids)
    if n <= max_len:
        return ids, 0
    if truncate is None:
        raise FfkvError(f"the text is {n:,} tokens long; {limit} takes at most {max_len:,}{hint}")
    dropped = n - max_len
    return (ids[dropped:] if truncate == "left" else ids[:max_len]), dropped


def truncation_note(truncated: dict | None) -> str | None:
    """The line said on stderr for a cut text (None when nothing was cut)."""
    if not truncated:
        return None
    kept = "end" if truncated["side"] == "left" else "start"
    return (f"ffkv: the text was cut to the model's context: dropped {truncated['dropped_tokens']:,} "
            f"tokens at its {'start' if kept == 'end' else 'end'} (--truncate {truncated['side']})")


def fit_sentences(id_lists, max_len: int) -> tuple[list[list[int]], dict]:
    """Corpus sentences as the model holds them: (ids, cut), each longer than `max_len` cut to its
    first `max_len` tokens (`fit_context`'s "right"), cut = {sentences, dropped_tokens, context}.

    The rule for a corpus (mine, compose, normalize, `ffkv corpus`), unlike a user's one text: it is
    cut, never refused (one run-on sentence must not stop a pass over thousands), and always on the
    right, so no --truncate. A prefix's coefficients do not depend on the tokens after it, so every
    prefix kept is exactly what the model computes; only the prefixes past the context are not
    read. Cutting the start would change every prefix. The cut is said aloud: the steps' manifests
    keep the count (`counts.truncated`) and the lifecycle says it on stderr (`sentences_note`)."""
    out, n, dropped = [], 0, 0
    for ids in id_lists:
        kept, d = fit_context(ids, max_len, "right")
        out.append(kept)
        n, dropped = n + (d > 0), dropped + d
    return out, {"sentences": n, "dropped_tokens": dropped, "context": max_len}


def sentences_note(table: str, n_cut: int, n: int | None = None, context: int | None = None) -> str | None:
    """The note (a step's `warn`: stderr) for corpus sentences cut to the model's context (None when
    none was)."""
    if not n_cut:
        return None
    of = f" of {n:,}" if n is not None else ""
    cut = f"to their first {context:,} tokens" if context else "to it"
    return (f"{n_cut:,}{of} sentence(s) of `{table}` were longer than the model's context and were "
            f"cut {cut} (at their end: the prefixes past the context are not read)")
