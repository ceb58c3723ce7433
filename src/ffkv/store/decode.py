"""Token ids -> text from a run's `vocab` table, with no tokenizer: the one decoder of the report,
`ffkv show` (`query.key_triggers`) and the browser.

Decoding tokens one at a time breaks any character whose UTF-8 bytes span two tokens (Hebrew,
emoji, …: "��לו��"). Byte-level BPE vocabularies (GPT-2, Llama-3, SmolLM2) store each token as
its bytes mapped to printable characters (`bytes_to_unicode`), so the exact bytes of a prefix are
the concatenation of its tokens' bytes, decoded once. SentencePiece vocabularies: '▁' is a space
and <0xNN> a byte. Otherwise the concatenation of the per-token `text` column.

`Decoder.pieces(ids)` splits the decoded text back into one piece per token such that the pieces
join to exactly `decode(ids)`: a character belongs to the token that completes its bytes, so a
token holding only the first bytes of a character gets "".
"""
from __future__ import annotations

import codecs
import re
from functools import lru_cache

import numpy as np


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (byte-level BPE vocabularies use it)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


class Decoder:
    """Turns token ids into text (see the module docstring). `text`: per-token decoded text;
    `token`: the raw vocabulary entries (the `vocab` table's columns)."""

    def __init__(self, text: list[str], token: list[str] | None = None):
        self.text = list(text)
        self.token = list(token) if token is not None else self.text
        self.byte_of = {c: b for b, c in bytes_to_unicode().items()}
        sample = [t for t in self.token[: min(len(self.token), 5000)] if t]
        bl = np.mean([all(c in self.byte_of for c in t) for t in sample]) if sample else 0
        sp = np.mean(["▁" in t for t in sample]) if sample else 0
        self.mode = "bytelevel" if bl > 0.95 and sp < 0.05 else "sentencepiece" if sp > 0.1 else "text"

    @classmethod
    def of_frame(cls, vocab) -> "Decoder":
        """From a `vocab` table as a DataFrame (columns text and, when present, token)."""
        return cls(vocab["text"].tolist(), vocab["token"].tolist() if "token" in vocab.columns else None)

    def piece_bytes(self, i: int) -> bytes:
        i = int(i)
        if not 0 <= i < len(self.token):
            return b""
        t = self.token[i] or ""
        if self.mode == "bytelevel" and all(c in self.byte_of for c in t):
            return bytes(self.byte_of[c] for c in t)
        if self.mode == "sentencepiece":
            m = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", t)
            if m:
                return bytes([int(m.group(1), 16)])
            return t.replace("▁", " ").encode()
        return (self.text[i] or "").encode()

    def _strip(self, s: str) -> str:
        return s[1:] if self.mode == "sentencepiece" and s.startswith(" ") else s

    def decode(self, ids) -> str:
        return self._strip(b"".join(self.piece_bytes(i) for i in ids).decode("utf-8", errors="replace"))

    def pieces(self, ids) -> list[str]:
        """One string per token, joining to `decode(ids)`; a character goes to the token that
        completes its bytes (an incremental UTF-8 decoder, fed token by token)."""
        dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        out = [dec.decode(self.piece_bytes(i)) for i in ids]
        if out:
            out[-1] += dec.decode(b"", final=True)
        if self.mode == "sentencepiece":
            for j, p in enumerate(out):
                if p:
                    out[j] = self._strip(p)
                    break
        return out

    def token_text(self, i) -> str:
        return self.text[int(i)] if 0 <= int(i) < len(self.text) else f"<{i}>"

    def marked(self, ids, position: int) -> tuple[str, str]:
        """(head, last) of the prefix ids[:position + 1], as text: they join to its decoding, and
        `last` is what the trigger token completes (a character split over tokens goes whole to
        the token that ends it)."""
        p = self.pieces(list(ids)[: position + 1])
        return ("".join(p[:-1]), p[-1]) if p else ("", "")
