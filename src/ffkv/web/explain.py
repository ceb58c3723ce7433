"""Explain one prediction layer by layer, and intervene on its memories.

`explain(mm, text, top)` follows the next-token prediction w at the text's last position (or at
`pos`) through the layers. Per layer ℓ it reads, under both lenses (`Lens` "naive" and "norm"), the residual
before the FFN (r), the FFN's own output (y) and the residual after it (o): their top tokens and
the probability and logit of w. It ranks the layer's memories by their signed contribution to w,
both those pushing w up and those pushing it down, and likewise for a contrast token. Under the
norm lens a contribution is a share of w's logit (direct logit attribution):
m_i·(v_i·(g⊙e_w))/s, s the final norm's scale at the last position's final residual, frozen at
the unedited pass (`Lens.logit_scale`; v_i centred where the norm is a LayerNorm,
`Lens.contribution_logits`), so that all writes' shares add up to the logit (tests/test_dla.py).
Under the naive lens it is m_i·(v_i·e_w), in the naive lens's own units (`contrib_units` says
which). m_i is from the capture, which tests hold equal to `MemoryModel.coefficients`.

With `interventions` (`ffkv.parse.Intervention`: scale or set chosen m_i, at the last position or
at every position, through `MemoryModel.intervene`), a second forward pass runs with the edits.
Its result (`intervened`) has the same shape as the original's and is read with the same w and
contrast, so the two compare number by number; its own prediction is in `intervened.prediction`.

The result (JSON-ready; `explain` in the CLI and `/api/explore` in the web return it):
  text, tokens (each token as text), n_tokens (the text's), pos (the position explained), token
    (the token there), hardest (with `n_hardest`: layer, dim, coef, contrib), truncated (None, or with
    `truncate`: side, dropped_tokens, text_tokens: the text's own length), lens (of the contributions),
  contrib_units (what every contrib is in), contrib_scale (the factor applied to m_i·(v_i·e_w):
    1/s under the norm lens, times the head's linear factor; 1 under the naive lens), at,
  prediction, prediction_id, p, top (the model's top next tokens: token, id, p, logit),
  contrast (token, id, p, logit, rank: 0-based, the tokens with a higher logit; or None),
  layers: per layer {layer, top_r, top_y, top_o, p_final_in_r (chosen lens), memories (the
    `top` memories pushing w up: dim, coef, contrib, value_top), memories_down,
    lenses: {naive|norm: {r|y|o: {top: [token...], p, logit, p_contrast, logit_contrast}}}},
  top_memories: {up, down}: the strongest memories of all layers for w;
  contrast_memories: {up, down} for the contrast token (None without one);
    every memory entry: layer, dim, coef, contrib, contrib_contrast, value_top, value_tops;
  interventions: each edit with the coefficient before and after at the last position
    (coef, coef_after, contrib, contrib_after) and the contribution it had;
  intervened: {prediction, prediction_id, p, p_original (of w), top, contrast, layers,
    top_memories, contrast_memories} or None; changed: whether the prediction changed.
"""
from __future__ import annotations

import weakref
from contextlib import nullcontext

import torch

from ffkv.defs import LENSES
from ffkv.errors import FfkvError
from ffkv.memories.attribution import direct_effects
from ffkv.model.memories import Lens, lens_for, rank_of
from ffkv.parse import Intervention

QUANTS = ("r", "y", "o")
TOP_TOKENS = 3  # top tokens shown per lens reading and per value
TOP_NEXT = 10  # the model's next-token distribution shown


def fit_text(mm, text: str, max_tokens: int | None = None,
             truncate: str | None = None) -> tuple[list[int], dict | None]:
    """The text's token ids as `explain` reads them, and what was cut (None, or {side,
    dropped_tokens, text_tokens}). The limits are `max_tokens` (the web explorer's cap, which
    offers no --truncate), then the model's context; a longer text is refused unless `truncate`
    is "left" or "right" (`ffkv.model.context.fit_context`, the one rule)."""
    from ffkv.model.context import TRUNCATE_HINT, check_truncate, fit_context

    truncate = check_truncate(truncate)
    ids = mm.tok(text, add_special_tokens=True)["input_ids"]
    n = len(ids)
    hint = TRUNCATE_HINT if max_tokens is None else ""
    dropped = 0
    if max_tokens is not None:
        ids, dropped = fit_context(ids, max_tokens, truncate, limit="explain", hint=hint)
    ids, more = fit_context(ids, mm.max_length, truncate,
                            limit=f"the model's context ({mm.max_length:,} tokens)", hint=hint)
    dropped += more
    if not ids:
        raise FfkvError("the text is empty after tokenization")
    cut = {"side": truncate, "dropped_tokens": dropped, "text_tokens": n} if dropped else None
    return ids, cut


def tokenize(mm, text: str, max_tokens: int | None = None) -> list[int]:
    """The text's token ids as `explain` reads them; longer than the model's context (or
    `max_tokens`): FfkvError (`fit_text` without truncation)."""
    return fit_text(mm, text, max_tokens)[0]


def resolve_token(mm, token: int | str) -> int:
    """A contrast token given as an id or as text that is exactly one token."""
    if isinstance(token, int):
        if not 0 <= token < mm.vocab_size:
            raise FfkvError(f"contrast token id {token} out of range 0..{mm.vocab_size - 1}")
        return token
    ids = mm.tok(token, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        pieces = [mm.tok.decode([i]) for i in ids]
        hint = ""
        if not token.startswith(" "):
            sp = mm.tok(" " + token, add_special_tokens=False)["input_ids"]
            if len(sp) == 1:
                hint = f"; {' ' + token!r} (with a leading space) is one token"
        raise FfkvError(f"the contrast {token!r} is {len(ids)} tokens {pieces}, not one{hint}")
    return int(ids[0])


def _lenses(mm) -> dict[str, Lens]:
    """Both lenses, by name."""
    return {name: lens_for(mm, name) for name in LENSES}


# Top tokens of sign(m)·v per (lens, layer, dim, sign), per model: values are weights, so a memory
# read once (in the original pass, or an earlier request) is not projected onto the vocabulary again.
_VALUE_TOPS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
VALUE_TOPS_CACHE = 200_000


def _value_tops(mm, lens: Lens, keys: list[tuple[int, int, int]]) -> dict:
    """{(layer, dim, sign): top token ids of sign·v_dim under `lens`}, computing only the new ones."""
    cache = _VALUE_TOPS.setdefault(mm, {})
    new = [k for k in dict.fromkeys(keys) if (lens.name, *k) not in cache]
    if new:
        vecs = torch.stack([mm.values(l)[i] * float(sg) for l, i, sg in new])
        for k, t in zip(new, lens.direction_logits(vecs).topk(TOP_TOKENS, -1).indices.tolist()):
            cache[(lens.name, *k)] = t
        while len(cache) > VALUE_TOPS_CACHE:
            cache.pop(next(iter(cache)))
    return {k: cache[(lens.name, *k)] for k in keys}


@torch.no_grad()
def _lens_readings(cap, layers, lenses: dict, targets) -> dict:
    """r, y, o of every layer at the last position, read through each lens as one (3L, d) block:
    mode -> (top token ids, logits of the targets, probabilities of the targets)."""
    states = torch.stack([cap[l][q][0, -1] for l in layers for q in QUANTS])
    readings = {}
    for mode, ln in lenses.items():
        lg = ln.logits(states).float()  # (3L, V)
        at_t = lg[:, targets]
        readings[mode] = (lg.topk(TOP_TOKENS, -1).indices.tolist(), at_t.tolist(),
                          torch.exp(at_t - torch.logsumexp(lg, -1, keepdim=True)).tolist())
    return readings


def _layer_row(l: int, readings: dict, k0: int, lens_mode: str, has_contrast: bool, dec, up, down) -> dict:
    """One layer's row: r, y, o under every lens (rows k0..k0+2 of the readings), its memories."""
    lens_rows = {}
    for mode, (tops, lg, pr) in readings.items():
        lens_rows[mode] = {q: {"top": [dec(t) for t in tops[k0 + k]],
                               "p": pr[k0 + k][0], "logit": lg[k0 + k][0],
                               "p_contrast": pr[k0 + k][1] if has_contrast else None,
                               "logit_contrast": lg[k0 + k][1] if has_contrast else None}
                           for k, q in enumerate(QUANTS)}
    ch = lens_rows[lens_mode]
    return {"layer": l, "top_r": ch["r"]["top"][0], "top_y": ch["y"]["top"][0], "top_o": ch["o"]["top"][0],
            "p_final_in_r": ch["r"]["p"], "memories": up, "memories_down": down, "lenses": lens_rows}


def _read(mm, ids: list[int], w: int | None, contrast: int | None, lens_mode: str, top: int,
          edits=(), at: str = "last", base: dict | None = None, scale: torch.Tensor | None = None) -> dict:
    """One forward pass (with `edits` applied) read at the last position for tokens w and contrast.

    w None: the run's own prediction. `base`: the unedited read of the same text; the layers
    before the first edited one compute exactly what they computed there, so their readings
    are taken from it rather than computed again. `scale`: the lens's `logit_scale` the
    contributions use (default: base's, so an edited pass is read at the clean run's frozen
    scale and its numbers compare with the clean ones; without base, this pass's own)."""
    L = mm.n_layers
    first = min((e[0] for e in edits), default=0) if base is not None else 0
    inp, mask = mm.batch([ids])
    with mm.intervene(edits, at=at) if edits else nullcontext():
        cap = mm.capture(inp, mask, layers=range(first, L), what=("r", "m", "y", "o"), logits=True)
    logits = cap.logits[0, -1].float()
    lse = torch.logsumexp(logits, -1)
    pred = int(logits.argmax())
    w = pred if w is None else w
    targets = torch.tensor([w] if contrast is None else [w, contrast], device=mm.device)
    dec = lambda i: mm.tok.decode([int(i)])  # noqa: E731
    lenses = _lenses(mm)
    lens = lenses[lens_mode]
    new = range(first, L)

    def token_row(i):
        # log p from the logits, not log(p): a p that underflows to 0 keeps its log-probability
        return {"token": dec(i), "id": int(i), "p": float(torch.exp(logits[i] - lse)), "logit": float(logits[i]),
                "logp": float(logits[i] - lse)}

    readings = _lens_readings(cap, new, lenses, targets)
    # the signed contribution of every memory to w (and the contrast), (L, d_m, n): its share of
    # the logit, m_i·(v_i·e_t) times the lens's scale at the final residual (`Lens.logit_scale`)
    if scale is None:
        scale = base["_scale"] if base is not None else lens.logit_scale(cap[L - 1]["o"][0, -1])
    m = torch.stack([cap[l]["m"][0, -1] for l in new])  # (L, d_m)
    contrib = direct_effects(mm, lens, m, new, targets, scale)
    if first:
        m, contrib = torch.cat([base["_m"][:first], m]), torch.cat([base["_contrib"][:first], contrib])
    # memories are chosen first (as (layer, dim) keys), then their values read in one batch
    signed = {(col, sign): contrib[..., col] * sign for col in range(len(targets)) for sign in (1, -1)}

    def ranked(col, sign, k, layer=None):
        c = signed[col, sign]
        if layer is not None:
            return [(layer, i) for i in c[layer].topk(min(k, mm.d_m)).indices.tolist()]
        return [divmod(j, mm.d_m) for j in c.flatten().topk(min(k, c.numel())).indices.tolist()]

    layers = [base["layers"][l] if l < first else  # unchanged: the original pass's row
              _layer_row(l, readings, 3 * (l - first), lens_mode, contrast is not None, dec,
                         ranked(0, 1, top, l), ranked(0, -1, top, l))
              for l in range(L)]
    tops = {"up": ranked(0, 1, top * 3), "down": ranked(0, -1, top * 3)}
    ctops = None if contrast is None else {"up": ranked(1, 1, top * 3), "down": ranked(1, -1, top * 3)}
    keys = sorted({k for r in layers[first:] for k in r["memories"] + r["memories_down"]}
                  | {k for t in (tops, ctops or {}) for ks in t.values() for k in ks})
    # the value's top tokens, of sign(m)·v as the memory writes it
    sg = {k: 1 if m[k] >= 0 else -1 for k in keys}
    vt = _value_tops(mm, lens, [(l, i, sg[l, i]) for l, i in keys])
    vtops = {k: vt[(*k, sg[k])] for k in keys}

    def memory(key):
        l, i = key
        return {"layer": l, "dim": i, "coef": float(m[l, i]) + 0.0, "contrib": float(contrib[l, i, 0]),
                "contrib_contrast": float(contrib[l, i, 1]) if contrast is not None else None,
                "value_top": dec(vtops[key][0]), "value_tops": [dec(t) for t in vtops[key]]}

    for r in layers[first:]:
        r["memories"] = [memory(k) for k in r["memories"]]
        r["memories_down"] = [memory(k) for k in r["memories_down"]]
    return {
        "prediction": dec(pred), "prediction_id": pred, "p": float(torch.exp(logits[pred] - lse)),
        "p_original": float(torch.exp(logits[w] - lse)), "logit_original": float(logits[w]),
        "top": [token_row(i) for i in logits.topk(min(TOP_NEXT, logits.numel())).indices.tolist()],
        "contrast": None if contrast is None else {
            **token_row(contrast), "rank": int(rank_of(logits, torch.tensor(contrast, device=logits.device)))},
        "layers": layers,
        "top_memories": {k: [memory(x) for x in v] for k, v in tops.items()},
        "contrast_memories": None if ctops is None else {k: [memory(x) for x in v] for k, v in ctops.items()},
        "_m": m, "_contrib": contrib, "_scale": scale,
    }


def _edit_rows(res: dict, after: dict | None, edits) -> list[dict]:
    rows = []
    for iv in edits:
        l, d = iv.layer, iv.dim
        rows.append({"layer": l, "dim": d, "op": iv.op, "value": iv.value, "edit": str(iv),
                     "coef": float(res["_m"][l, d]), "contrib": float(res["_contrib"][l, d, 0]),
                     "coef_after": None if after is None else float(after["_m"][l, d]) + 0.0,
                     "contrib_after": None if after is None else float(after["_contrib"][l, d, 0]) + 0.0})
    return rows


def _public(r: dict) -> dict:
    return {k: v for k, v in r.items() if not k.startswith("_")}


@torch.no_grad()
def explain(mm, text: str, top_memories: int = 3, interventions=(), at: str = "last",
            contrast: int | str | None = None, lens: str | None = None,
            max_tokens: int | None = None, truncate: str | None = None, *, ids: list[int] | None = None,
            pos: int | None = None, n_hardest: int = 0) -> dict:
    """Explain the next-token prediction of `text`, optionally under `interventions`.

    `lens`: the lens of the contributions and of top_r/top_y/top_o (default: the model's).
    `interventions`: `Intervention`s (or (layer, dim, op, value) tuples), applied `at` the
    explained position or at all positions. `contrast`: a token id, or text that is one token.
    A text longer than the model's context (or `max_tokens`) is refused, or with `truncate`
    ("left": keep its end, "right": keep its start) cut, and the cut recorded in `truncated`.
    `pos`: the position explained (`resolve_pos`; default the last): a causal model's prediction
    there reads the tokens up to it only, so only those are run. `ids`: the text's token ids when
    the caller has fitted them already. `n_hardest`: also the memories of every layer with the
    largest |m| there (`hardest`, of the unedited pass).
    """
    lens = lens or mm.lens.name
    if lens not in LENSES:
        raise FfkvError(f"unknown lens {lens!r}; choose naive or norm")
    if at not in ("last", "all"):
        raise FfkvError(f"--at {at!r}: choose last or all")
    if top_memories < 1:
        raise FfkvError("--top must be at least 1")
    edits = [Intervention(*iv) for iv in interventions]
    for iv in edits:
        if not (0 <= iv.layer < mm.n_layers and 0 <= iv.dim < mm.d_m):
            raise FfkvError(f"memory {iv.layer}:{iv.dim} out of range: layers 0..{mm.n_layers - 1}, "
                            f"dims 0..{mm.d_m - 1}")
    ids, cut = fit_text(mm, text, max_tokens, truncate) if ids is None else (list(ids), None)
    p = resolve_pos(pos, len(ids))
    prefix = ids[:p + 1]
    c = None if contrast is None or contrast == "" else resolve_token(mm, contrast)
    base = _read(mm, prefix, None, c, lens, top_memories)
    w = base["prediction_id"]
    after = _read(mm, prefix, w, c, lens, top_memories, edits, at, base=base) if edits else None
    ln = lens_for(mm, lens)
    tokens = [mm.tok.decode([i]) for i in ids]
    res = {"text": text, "tokens": tokens, "n_tokens": len(ids), "truncated": cut, "pos": p, "token": tokens[p],
           "lens": lens, "contrib_units": ln.units, "contrib_scale": float(base["_scale"]),
           "at": at, **_public(base),
           "interventions": _edit_rows(base, after, edits),
           "intervened": None if after is None else _public(after),
           "changed": None if after is None else after["prediction_id"] != w}
    if n_hardest:
        res["hardest"] = hardest(base["_m"], base["_contrib"][..., 0], n_hardest)
    res.pop("p_original"), res.pop("logit_original")
    res["logit"] = base["logit_original"]
    return res


def resolve_pos(pos: int | None, n: int) -> int:
    """The 0-based position `pos` names in a text of `n` tokens: None the last, a negative one
    counted from the end (-1 the last); outside the text, one FfkvError line saying its range."""
    p = n - 1 if pos is None else pos + n if pos < 0 else pos
    if not 0 <= p < n:
        raise FfkvError(f"pos {pos} is outside the text: its {n} token{'s' if n != 1 else ''} are at positions "
                        f"0..{n - 1} (or -{n}..-1 from the end)")
    return p


def hardest(m, contrib, k: int) -> list[dict]:
    """The `k` memories of all layers with the largest |m| at one position, from the (L, d_m)
    coefficients `m` and the (L, d_m) contributions to the prediction `contrib`: layer, dim, coef,
    contrib. Ties: layer, then dim (a stable sort of the flat layer × d_m order)."""
    import numpy as np

    a = m.abs().flatten().double().cpu().numpy()
    order = np.argsort(-a, kind="stable")[:k]
    d_m = m.shape[1]
    flat_m, flat_c = m.flatten().tolist(), contrib.flatten().tolist()
    return [{"layer": int(j) // d_m, "dim": int(j) % d_m, "coef": float(flat_m[j]) + 0.0,
             "contrib": float(flat_c[j]) + 0.0} for j in order]
