"""How a text meets a model's context: the one rule for every reader of a user's text (`ffkv
explain`, the web explorer through `ffkv.experiments.explain`).

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
