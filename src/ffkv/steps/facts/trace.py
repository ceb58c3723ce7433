"""`facts trace`: causal tracing as Meng et al. (ROME, 2022; `kmeng01/rome`,
experiments/causal_trace.py) define it.

- Clean run: P(target) at the last token (the target's first token id).
- Corrupted run: Gaussian noise of std `noise`·σ is added to the input embeddings of the subject's
  tokens, σ the std of the vectors the embedding module gives the first layer (`embedding_sigma`:
  over the whole vocabulary unless given; Gemma's module already scales by √d). `samples` draws,
  seeded (a torch.Generator), the same draws for every restoration; P is their mean.
- Restoring kind k at (token t, layer l): the corrupted run with that state set at token t to its
  clean value. "hidden": the block's output (the residual stream after layer l); "ffn": what the
  FFN adds (y, where ffkv's captures read it: after a post-FFN norm its output); "attn": what the
  attention block adds (`Architecture.edit_attn`). ffn and attn restore the layers of a window of
  `window` layers about l, ROME's max(0, l − w//2) .. min(L, l − w//2 + w) (exclusive end);
  hidden restores layer l alone.
- Indirect effect IE(t, l) = P_restored(t, l) − P_corrupt.

Every (kind, token, layer) × sample is one row of a batch of copies of the prompt, each row with
its own restoration, `batch` rows a forward pass: a fact's trace costs about the forward passes of
its T·L·(kinds)·samples rows (`TraceResult.forwards`).

`summary` averages results over facts into ROME's heatmap rows (`GROUPS`), and `rome_verdict`
tests ROME's finding (the FFN's effect peaks at the last subject token, in middle layers) with a
bootstrap interval over facts.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np
import torch

from ffkv.errors import FfkvError

KINDS = ("hidden", "ffn", "attn")
NOISE = 3.0  # × σ (ROME: ν = 3σ)
WINDOW = 10  # ROME's window of restored layers for ffn and attn
SAMPLES = 10  # ROME's noise draws per fact
GROUPS = ("first subject token", "middle subject tokens", "last subject token",
          "first subsequent token", "further tokens", "last token")  # ROME's Fig. heatmap rows


@dataclass
class TraceResult:
    """One fact's causal trace. `effect[kind]` (T, L) float64: IE = P_restored − P_corrupt."""
    prompt: str
    tokens: list[str]  # the prompt's tokens, decoded
    subject: tuple[int, int]  # token span [start, end)
    target: int  # the token id whose P is traced
    p_clean: float
    p_corrupt: float
    effect: dict[str, np.ndarray] = field(repr=False)
    sigma: float = 0.0  # the embeddings' std the noise is scaled by
    noise: float = NOISE
    seed: int = 0
    window: int = WINDOW
    samples: int = SAMPLES
    forwards: int = 0  # forward passes it took, the clean one included
    rows: int = 0  # rows over them

    @property
    def last_subject(self) -> int:
        return self.subject[1] - 1

    def restored(self, kind: str) -> np.ndarray:
        """P_restored (T, L) of `kind`."""
        return self.effect[kind] + self.p_corrupt


# ---- inputs ------------------------------------------------------------------------------------------------
def _char_spans(tok, text: str, ids: list[int]) -> list[tuple[int, int]]:
    """Each token's [start, end) characters in `text`: the fast tokenizer's offsets, else the
    lengths of the decoded prefixes (special tokens: empty)."""
    if getattr(tok, "is_fast", False):
        enc = tok(text, return_offsets_mapping=True)
        if list(enc["input_ids"]) == list(ids):
            return [tuple(map(int, o)) for o in enc["offset_mapping"]]
    spans, end = [], 0
    for i in range(len(ids)):
        new = len(tok.decode(ids[:i + 1], skip_special_tokens=True))
        spans.append((end, new) if new > end else (end, end))
        end = max(end, new)
    return spans


def subject_span(tok, text: str, subject: str, ids: list[int] | None = None) -> tuple[int, int]:
    """[start, end) of the tokens of `text` (tokenized as `tok(text)`, or `ids`) that overlap the
    first occurrence of `subject` in it."""
    ids = list(tok(text)["input_ids"]) if ids is None else list(ids)
    s = subject.strip()
    c0 = text.find(s) if s else -1
    if c0 < 0:
        raise FfkvError(f"subject {s!r} is not in the prompt {text!r}")
    c1 = c0 + len(s)
    hit = [i for i, (a, b) in enumerate(_char_spans(tok, text, ids)) if b > a and a < c1 and b > c0]
    if not hit:
        raise FfkvError(f"subject {s!r} covers no token of the prompt {text!r}")
    return hit[0], hit[-1] + 1


def target_id(tok, target: int | str) -> int:
    """A token id, or the first token of a string (e.g. " Paris")."""
    if isinstance(target, (int, np.integer)):
        return int(target)
    from ffkv.steps.facts.data import target_ids

    ids = target_ids(tok, target)
    if not ids:
        raise FfkvError(f"target {target!r} has no token")
    return int(ids[0])


@torch.no_grad()
def embedding_sigma(mm, ids=None, chunk: int = 8192) -> float:
    """The std, over all elements, of the embedding module's output (what the first layer is fed,
    Gemma's √d included) for token ids `ids`, or the whole vocabulary (ROME's code measures it over
    its facts' subjects: pass their ids for that). Cached per model while the weights stay."""
    emb = mm.hf.get_input_embeddings()
    w = emb.weight
    key = (id(w), w._version, None if ids is None else tuple(int(i) for i in ids))
    cache = mm.__dict__.setdefault("_embedding_sigma", {})
    if key not in cache:
        all_ids = torch.arange(w.shape[0]) if ids is None else torch.as_tensor(list(ids), dtype=torch.long)
        s = s2 = 0.0
        n = 0
        for i in range(0, len(all_ids), chunk):
            e = emb(all_ids[i:i + chunk].to(w.device)[None])[0].double()
            s += float(e.sum())
            s2 += float(e.pow(2).sum())
            n += e.numel()
        mean = s / n
        cache[key] = float(np.sqrt(max(s2 / n - mean * mean, 0.0) * n / max(n - 1, 1)))
    return cache[key]


def window_of(layer: int, n_layers: int, window: int) -> tuple[int, int]:
    """ROME's restored layers about `layer`: [max(0, l − w//2), min(L, l − w//2 + w))."""
    lo = layer - window // 2
    return max(0, lo), min(n_layers, lo + window)


def _auto_batch(mm, T: int, total: int) -> int:
    """Rows a forward pass: 256 on a CPU; on CUDA a quarter of the free memory over a row's rough
    peak (a few layers' activations and its logits)."""
    if mm.device.type != "cuda":
        return min(total, 256)
    free = torch.cuda.mem_get_info(mm.device)[0]
    item = torch.finfo(mm.dtype).bits // 8
    per_row = T * (16 * mm.d + 4 * mm.d_m) * item + 8 * mm.vocab_size
    return int(max(1, min(total, free // 4 // per_row)))


# ---- the engine --------------------------------------------------------------------------------------------
class _Tracer:
    """Hooks and forward passes of one prompt: the clean states, then batches of rows."""

    def __init__(self, mm, ids: torch.Tensor, span: tuple[int, int], target: int, kinds):
        self.mm, self.ids, self.span, self.target, self.kinds = mm, ids, span, target, tuple(kinds)
        self.T = ids.shape[-1]
        self.shape = [1, self.T]
        self.keep = "logits_to_keep" in inspect.signature(mm.hf.forward).parameters
        self.forwards = 0

    def _sites(self, kind: str, layer: int, fn) -> list:
        """Hooks that call fn(state (B, T, d)) at kind's site of layer; a tensor fn returns replaces it."""
        mm = self.mm
        blk = mm.blocks[layer]
        if kind == "ffn":
            return mm.arch.edit_y(blk, fn, self.shape)
        if kind == "attn":
            return mm.arch.edit_attn(blk, fn, self.shape)

        def on_block(mod, args, out):  # hidden: the block's output, the residual stream after it
            h = out[0] if isinstance(out, tuple) else out
            new = fn(h)
            if new is None:
                return None
            return (new.to(h.dtype), *out[1:]) if isinstance(out, tuple) else new.to(h.dtype)
        return [blk.register_forward_hook(on_block)]

    def _p(self, hooks: list, B: int) -> torch.Tensor:
        """P(target) at the last token of B copies of the prompt under `hooks` (removed after)."""
        self.shape[:] = [B, self.T]
        kw = {"logits_to_keep": 1} if self.keep else {}
        try:
            logits = self.mm.hf(input_ids=self.ids.expand(B, -1), use_cache=False, **kw).logits
        finally:
            for h in hooks:
                h.remove()
        self.forwards += 1
        return torch.softmax(logits[:, -1].float(), -1)[:, self.target]

    @torch.no_grad()
    def clean(self) -> float:
        """The clean run: P_clean, and every layer's states of the kinds asked, kept."""
        self.states = {k: [None] * self.mm.n_layers for k in self.kinds}
        hooks = []
        for k in self.kinds:
            for l in range(self.mm.n_layers):
                def keep(s, k=k, l=l):
                    self.states[k][l] = s[0].detach().clone()
                hooks += self._sites(k, l, keep)
        return float(self._p(hooks, 1)[0])

    @torch.no_grad()
    def rows(self, z: torch.Tensor, kind: np.ndarray, tok: np.ndarray, lo: np.ndarray, hi: np.ndarray,
             sample: np.ndarray) -> torch.Tensor:
        """P of B rows: row b noised by z[sample[b]] on the subject, and kind[b]'s state (−1: none)
        restored at token tok[b] in layers lo[b]..hi[b] − 1."""
        B = len(kind)
        dev = self.mm.device
        s0, s1 = self.span
        noise = z[torch.as_tensor(sample)].to(dev)

        def corrupt(mod, args, out):
            e = out.clone()
            e[:, s0:s1] += noise.to(e.dtype)
            return e
        hooks = [self.mm.hf.get_input_embeddings().register_forward_hook(corrupt)]
        for ki, k in enumerate(self.kinds):
            for l in range(self.mm.n_layers):
                sel = np.nonzero((kind == ki) & (lo <= l) & (l < hi))[0]
                if len(sel) == 0:
                    continue
                r = torch.as_tensor(sel, device=dev)
                t = torch.as_tensor(tok[sel], device=dev)
                clean = self.states[k][l][t]

                def restore(s, r=r, t=t, clean=clean):
                    s = s.clone()
                    s[r, t] = clean.to(s.dtype)
                    return s
                hooks += self._sites(k, l, restore)
        return self._p(hooks, B)


def trace(mm, prompt: str, subject: str | tuple[int, int], target: int | str, *, kinds=KINDS,
          window: int = WINDOW, noise: float = NOISE, samples: int = SAMPLES, seed: int = 0,
          batch: int | None = None, sigma: float | None = None) -> TraceResult:
    """The causal trace of one fact: `prompt` the text, `subject` a substring of it (or a token span
    [start, end)), `target` the true object (a token id, or a string whose first token is traced).

    `noise` × σ is the noise's std (σ: `sigma`, else `embedding_sigma(mm)`); `samples` seeded draws;
    `window` layers restored for ffn and attn; `batch` rows a forward pass (None: `_auto_batch`).
    Results do not depend on `batch`."""
    kinds = tuple(kinds)
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise FfkvError(f"trace kinds {bad or '(none)'}: choose from {', '.join(KINDS)}")
    if samples < 1 or window < 1 or noise < 0:
        raise FfkvError(f"trace needs samples ≥ 1, window ≥ 1 and noise ≥ 0 (got {samples}, {window}, {noise})")
    from ffkv.steps.facts.data import prompt_ids

    tok = mm.tok
    id_list = prompt_ids(tok, prompt, mm.max_length)
    if not id_list:
        raise FfkvError(f"the prompt {prompt!r} has no token")
    T, L = len(id_list), mm.n_layers
    if isinstance(subject, str):
        span = subject_span(tok, prompt, subject, id_list)
    else:
        span = (int(subject[0]), int(subject[1]))
        if not 0 <= span[0] < span[1] <= T:
            raise FfkvError(f"subject span {span} outside the prompt's {T} tokens")
    tid = target_id(tok, target)
    if not 0 <= tid < mm.vocab_size:
        raise FfkvError(f"target id {tid} outside the vocabulary 0..{mm.vocab_size - 1}")
    sig = embedding_sigma(mm) if sigma is None else float(sigma)

    ids = torch.tensor([id_list], device=mm.device)
    tr = _Tracer(mm, ids, span, tid, kinds)
    p_clean = tr.clean()

    g = torch.Generator(device="cpu").manual_seed(int(seed))
    z = torch.randn(samples, span[1] - span[0], mm.d, generator=g, dtype=torch.float32) * (noise * sig)

    # jobs: the corrupted run (kind −1), then kind × token × layer; each job × samples rows
    kind_j, tok_j, lo_j, hi_j = [-1], [0], [0], [0]
    for ki, k in enumerate(kinds):
        w = 1 if k == "hidden" else window
        for t in range(T):
            for l in range(L):
                a, b = window_of(l, L, w) if w > 1 else (l, l + 1)
                kind_j.append(ki), tok_j.append(t), lo_j.append(a), hi_j.append(b)
    rep = lambda a: np.repeat(np.asarray(a, dtype=np.int64), samples)  # noqa: E731
    kind_r, tok_r, lo_r, hi_r = rep(kind_j), rep(tok_j), rep(lo_j), rep(hi_j)
    sample_r = np.tile(np.arange(samples), len(kind_j))
    n = len(kind_r)
    B = int(batch) if batch else _auto_batch(mm, T, n)
    p = torch.empty(n, dtype=torch.float32)
    for r0 in range(0, n, max(1, B)):
        sl = slice(r0, min(n, r0 + max(1, B)))
        p[sl] = tr.rows(z, kind_r[sl], tok_r[sl], lo_r[sl], hi_r[sl], sample_r[sl]).cpu()
    pj = p.double().view(len(kind_j), samples).mean(1).numpy()
    p_corrupt = float(pj[0])
    effect = {k: pj[1 + i * T * L:1 + (i + 1) * T * L].reshape(T, L) - p_corrupt for i, k in enumerate(kinds)}
    return TraceResult(prompt=prompt, tokens=[tok.decode([i]) for i in id_list], subject=span, target=tid,
                       p_clean=p_clean, p_corrupt=p_corrupt, effect=effect, sigma=sig, noise=float(noise),
                       seed=int(seed), window=int(window), samples=int(samples), forwards=tr.forwards, rows=n)


def trace_many(mm, facts: Iterable, *, show_progress: bool | None = None, **kw) -> list[TraceResult]:
    """`trace` of each (prompt, subject, target) in `facts`, with the one progress bar."""
    from ffkv.progress import progress

    facts = list(facts)
    out, tokens = [], 0
    with progress(disable=None if show_progress is None else not show_progress) as bar:
        task = bar.add_task("trace", total=len(facts), tokens=0)
        for prompt, subject, target in facts:
            r = trace(mm, prompt, subject, target, **kw)
            out.append(r)
            tokens += r.rows * len(r.tokens)  # the tokens its forward passes ran
            bar.update(task, advance=1, tokens=tokens)
    return out


# ---- averages and the verdict ------------------------------------------------------------------------------
def groups(r: TraceResult) -> list[list[int]]:
    """The token indices of each of ROME's rows (`GROUPS`) in one result: first, middle and last
    subject token, the first token after the subject, further tokens, the last token (ROME's
    average_causal_effects: a token after the subject is "first subsequent" or "further" only
    when it is not the last token)."""
    s0, s1 = r.subject
    T = len(r.tokens)
    first_after = [s1] if s1 < T - 1 else []
    return [[s0], list(range(s0 + 1, s1 - 1)), [s1 - 1], first_after, list(range(s1 + 1, T - 1)), [T - 1]]


def summary(results: Sequence[TraceResult]) -> dict:
    """ROME's average heatmaps: per kind a (6, L) array, row g the mean indirect effect over every
    token of group g (`GROUPS`) of every fact, pooled as ROME pools them; `counts` the tokens
    pooled per row (a middle row of 0 tokens is NaN)."""
    if not results:
        raise FfkvError("no trace results to summarise")
    kinds = [k for k in results[0].effect if all(k in r.effect for r in results)]
    L = results[0].effect[kinds[0]].shape[1]
    counts = np.zeros(len(GROUPS), dtype=np.int64)
    sums = {k: np.zeros((len(GROUPS), L)) for k in kinds}
    for r in results:
        for g, toks in enumerate(groups(r)):
            counts[g] += len(toks)
            for k in kinds:
                if toks:
                    sums[k][g] += r.effect[k][toks].sum(0)
    with np.errstate(invalid="ignore", divide="ignore"):
        effect = {k: sums[k] / counts[:, None] for k in kinds}
    return {"groups": GROUPS, "effect": effect, "counts": counts, "facts": len(results), "layers": L,
            "p_clean": float(np.mean([r.p_clean for r in results])),
            "p_corrupt": float(np.mean([r.p_corrupt for r in results]))}


def rome_verdict(results: Sequence[TraceResult], kind: str = "ffn", draws: int = 2000, seed: int = 0) -> dict:
    """ROME's finding, tested: the FFN's indirect effect is larger at the last subject token than at
    the prompt's other tokens from the subject on (the baseline), and it peaks in middle layers.

    Per fact, d = mean over layers of IE(last subject token) − the same mean over ROME's other rows
    but the last token (`groups`: the first and middle subject tokens, the first subsequent and
    further tokens; the last token is left out, as its effect is the whole prediction's, and tokens
    before the subject are left out, as the noise cannot reach them), for every fact that has such a
    token; a 95% percentile bootstrap interval of mean d
    over facts (scipy, `draws` resamples, seeded) gives the verdict (`ffkv.report.stats.by_interval`:
    above 0 same trend, below differs, else inconclusive). `peak_layer` is the argmax over layers of
    the mean IE at the last subject token, `peak_depth` its relative depth (ℓ + ½)/L, `middle`
    whether it lies in the middle third (`ffkv.report.stats.thirds`)."""
    from scipy.stats import bootstrap

    from ffkv.report.stats import INCONCLUSIVE, by_interval, depth, thirds

    if not results:
        raise FfkvError("no trace results to judge")
    d, last = [], []
    for r in results:
        e = r.effect[kind]
        last.append(e[r.last_subject])
        g = groups(r)
        other = g[0] + g[1] + g[3] + g[4]
        other = [t for t in other if t != r.last_subject]
        if other:
            d.append(float(e[r.last_subject].mean() - e[other].mean()))
    L = results[0].effect[kind].shape[1]
    curve = np.mean(last, 0)
    peak = int(np.argmax(curve))
    d = np.asarray(d)
    lo = hi = float("nan")
    if len(d) >= 2 and np.ptp(d) > 0:
        ci = bootstrap((d,), np.mean, n_resamples=draws, confidence_level=0.95, method="percentile",
                       random_state=np.random.default_rng(seed)).confidence_interval
        lo, hi = float(ci.low), float(ci.high)
    elif len(d) >= 2:
        lo = hi = float(d[0])
    verdict = by_interval(lo, hi) if lo == lo else INCONCLUSIVE
    return {"verdict": verdict, "kind": kind, "facts": len(results), "facts_judged": int(len(d)),
            "difference": float(d.mean()) if len(d) else float("nan"), "low": lo, "high": hi,
            "baseline": "the same fact's other tokens from the subject on, but the last", "peak_layer": peak,
            "peak_depth": float(depth(peak, L)), "middle": peak in thirds(range(L), L)[1],
            "criterion": (f"mean over layers of IE_{kind}(last subject token) − IE_{kind}(the other tokens "
                          f"from the subject on, but the last), 95% bootstrap interval over facts ({draws} resamples, seed {seed})")}
