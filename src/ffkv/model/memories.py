"""A causal LM seen as L layers of d_m key-value memories.

Definitions owned here (everything else calls them):
- `MemoryModel.coefficients`: the memory coefficient m_i.
- `is_active`: the active-memory test.
- `Lens` (`NaiveLens`, `NormLens`; `lens_for` picks one): top(h) and softmax(h·E), naive or
  through the final norm.
- `rank_of`: a target's rank, by counting logits above it.

Capabilities: `capture` reads r, x, m, y, o (and g, a gated FFN's gate pre-activations) in one
forward pass; `intervene` edits chosen
coefficients m_i (scale, suppress, set) where the model computes them; `replace_ffn` makes a
layer's FFN add something else. Where the hooks sit, and how m and v are read from the weights,
is the family's entry in `ffkv.model.arch`: nothing here names a family.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from ffkv.defs import LENSES, check_lens
from ffkv.errors import FfkvError
from ffkv.model.arch import Architecture, find, get_path, text_config

QUANTITIES = ("r", "x", "m", "y", "o", "g")  # g: a gated FFN's gate pre-activations (`Architecture.hook_g`)


class _Stop(Exception):
    """Raised by a hook after the last layer needed, to skip the rest of the forward pass."""


def pad_rows(flat: np.ndarray, lens: np.ndarray, pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) ids and mask on `device` of rows given one after another in `flat` (row b: lens[b]
    ids), right-padded. Built in numpy: two torch copies per row cost ~10 ms of host time on a
    2,000-row GPU batch, while the device waited. On CUDA the host arrays are pinned and copied
    without blocking, so the next batch's host work overlaps this one's transfer."""
    lens = np.asarray(lens, dtype=np.int64)
    valid = np.arange(int(lens.max()) if len(lens) else 0) < lens[:, None]
    ids = np.full(valid.shape, pad_id, dtype=np.int64)
    ids[valid] = flat
    ids, mask = torch.from_numpy(ids), torch.from_numpy(valid.astype(np.int64))
    dev = torch.device(device)
    if dev.type == "cuda":
        return ids.pin_memory().to(dev, non_blocking=True), mask.pin_memory().to(dev, non_blocking=True)
    return (ids, mask) if dev.type == "cpu" else (ids.to(dev), mask.to(dev))

@dataclass
class Captures:
    """Per requested layer, the captured tensors (B, T, ·) by name: r, x, m, y, o, g."""
    layers: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    logits: torch.Tensor | None = None

    def __getitem__(self, layer: int) -> dict[str, torch.Tensor]:
        return self.layers[layer]


def is_active(m: torch.Tensor, eps: float = 0.0) -> torch.Tensor:
    """The paper's active memory is m_i > 0; with eps > 0 it is |m_i| > eps (for SiLU/GELU)."""
    return m > 0 if eps <= 0 else m.abs() > eps


def rank_of(logits: torch.Tensor, target: torch.Tensor, below: torch.Tensor | None = None) -> torch.Tensor:
    """0-based rank of `target` in each row: the number of logits strictly above it. Where `below`
    (bool, one per row) holds, its rank in −logits instead: the number strictly below it, counted
    without negating the row. (`ffkv.steps.values.rows.signed_ranks` is this, compiled.)"""
    t = logits.gather(-1, target.unsqueeze(-1))

    def count(mask):
        # the bool mask summed as uint8 into int32 (exact: V < 2^31) is 4x faster on CPU than an
        # int64 accumulator, which casts element by element; values' ranks spent 27 s of 100 s there
        return mask.view(torch.uint8).sum(-1, dtype=torch.int32)

    if below is None:
        return count(logits > t).to(torch.int64)
    return torch.where(below, count(logits < t), count(logits > t)).to(torch.int64)


class Lens:
    """How a d-vector is read as a distribution over the vocabulary: one of `LENSES`, each a
    subclass (`NaiveLens`, `NormLens`), made by `lens_for(mm, name)`.

    Both share the model's unembedding E (+ bias) and its own head (`model_logits`); they differ in
    `logits` (residual states) and `direction_logits` (weight vectors). `name` is the public one
    (flags, manifest, table columns)."""

    name: str = ""
    MODES = LENSES

    def __init__(self, mm: "MemoryModel"):
        self.mm = mm
        self.unembed = mm.hf.get_output_embeddings() or get_path(mm.hf, mm.arch.unembed)
        self.final_norm = get_path(mm.hf, mm.arch.final_norm)
        self.E = self.unembed.weight  # (V, d)
        self.bias = getattr(self.unembed, "bias", None)
        gain = mm.arch.norm_gain(self.final_norm)
        self.gain = gain if gain is not None else torch.ones(self.E.shape[1], device=self.E.device)

    def _unembed(self, h: torch.Tensor) -> torch.Tensor:
        out = h @ self.E.T
        return out + self.bias if self.bias is not None else out

    @torch.no_grad()
    def model_logits(self, h: torch.Tensor) -> torch.Tensor:
        """(..., d) final residual states -> (..., V) logits as the model's own head computes them."""
        return self.mm.arch.head(self.mm.hf.config, self._unembed(self.final_norm(h.to(self.E.dtype))))

    @torch.no_grad()
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """(..., d) residual-stream states -> (..., V) logits."""
        raise NotImplementedError

    def _direction(self, v: torch.Tensor) -> torch.Tensor:
        """A weight direction as this lens sees it before E."""
        raise NotImplementedError

    @torch.no_grad()
    def direction_logits(self, v: torch.Tensor, tokens: torch.Tensor | None = None,
                         out: torch.Tensor | None = None) -> torch.Tensor:
        """(..., d) weight directions (values, keys) -> (..., V) float32 logits, or (..., len(tokens)).

        Float32 whatever the model's dtype: in bf16 half of a value's rows tie at their 20th token
        (random SmolLM2 shape), and top-k, ranks and the index all read ties. The weights are
        upcast exactly, so a bf16 model on a GPU gets the logits its weights give on a CPU.
        `out`: an optional preallocated float32 result (reused across chunks to avoid page faults)."""
        v = self._direction(v.float())
        return torch.matmul(v, (self.E if tokens is None else self.E[tokens]).float().T, out=out)

    # ---- direct logit attribution: a write's share of one state's logits --------------------
    units: str = ""  # what `contribution_logits` are in, shown beside them (JSON, explorer, CLI)

    @torch.no_grad()
    def logit_scale(self, h: torch.Tensor) -> torch.Tensor:
        """(..., d) final residual states -> (..., 1) float32 factor that turns this lens's
        `contribution_logits` into a share of the logits read at h."""
        raise NotImplementedError

    @torch.no_grad()
    def contribution_logits(self, v: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """(..., d) writes to the residual stream -> float32 logits per unit scale (times
        `logit_scale(h)`: their shares of the logits at h, which add up over the writes)."""
        return self.direction_logits(v, tokens)

    def top(self, h: torch.Tensor) -> torch.Tensor:
        return self.logits(h).argmax(-1)

    # ---- the top of a sum from its parts' logits ----------------------------------------------
    def _affine(self, h: torch.Tensor):
        """(scale (n, 1), offset (V,) or None, unembedded rows (n, d)) with logits(h) = A(h)·scale +
        offset, A linear in h and the rows what E multiplies; None where the head is not affine."""
        raise NotImplementedError  # each lens says

    @torch.no_grad()
    def sum_top(self, parts: list[torch.Tensor], zs: list[torch.Tensor], h: torch.Tensor):
        """top(h) for h = Σ parts (rows (n, d)), from the parts' own `logits` zs, without projecting
        h (compose: o = r + y). Returns (top (n,), sure (n,) bool), or None where this lens cannot
        (a soft-capped head, or a model whose head the check below does not reproduce).

        The parts' logits are summed in the lens's linear space (each undone by its row's scale,
        redone by h's). Sure where the derived top beats every other token by more than twice the
        float error bound of both the derived and the direct logits, so that it is exactly
        `logits(h).argmax(-1)`; the caller projects the other rows (near ties) itself."""
        if not self.sums_exactly():
            return None
        return self._sum_top(parts, zs, h)

    def _sum_top(self, parts, zs, h):
        zhat, tol = self._derive(parts, zs, h)
        best = zhat.max(-1)
        second = zhat.scatter_(-1, best.indices[:, None], float("-inf")).max(-1).values  # the runner-up
        return best.indices, (best.values - second) > tol[:, 0]

    def _derive(self, parts, zs, h):
        """(logits of h from its parts' logits (n, V) float32, tol (n, 1)): |derived − direct| ≤ tol/2
        for every token. The bound: a float product over d terms (and the norm and head around it)
        is off by at most (d + 16)·u times Σ|terms| ≤ ‖unembedded row‖·max‖E_t‖ (+ the offset);
        each part's error is carried over by its factor, and so is its scale's."""
        gamma = (h.shape[-1] + 16) * torch.finfo(zs[0].dtype).eps / 2
        sh, off, nh = self._affine(h)
        emax, cmax = self._bounds()
        zhat = None
        bound = 2 * (nh.float().norm(dim=-1, keepdim=True) * emax + cmax)  # direct logits of h, twice
        for p, z in zip(parts, zs):
            sp, _, npart = self._affine(p)
            a = sh / sp  # (n, 1)
            zp = z.float() if off is None else z.float() - off
            zhat = zp * a if zhat is None else zhat.addcmul_(zp, a)
            bound = bound + 2 * a.abs() * (npart.float().norm(dim=-1, keepdim=True) * emax + cmax)
        if off is not None:
            zhat += off
        return zhat, 2 * gamma * bound

    @torch.no_grad()
    def _bounds(self) -> tuple[float, float]:
        """(max_t ‖E_t‖ times the head's factor, max_t |offset_t|): the scale of every logit's error."""
        if "_bound_cache" not in self.__dict__:
            emax = float(self.E.detach().float().norm(dim=-1).max()) * abs(self._head_scale())
            off = self._offset()
            self._bound_cache = (emax, 0.0 if off is None else float(off.abs().max()))
        return self._bound_cache

    def _head_scale(self) -> float:
        return 1.0

    def _offset(self):
        return None if self.bias is None else self.bias.detach().float()

    @torch.no_grad()
    def sums_exactly(self) -> bool:
        """Once per lens: the head is affine, and on random sums the derived logits are within the
        bound of the direct ones (a family whose norm is not the one assumed fails)."""
        if "_sum_checked" not in self.__dict__:
            g = torch.Generator(device="cpu").manual_seed(0)
            r, y = (torch.randn(4, self.E.shape[1], generator=g) * s for s in (3.0, 1.0))
            r, y = (t.to(self.E.device, self.E.dtype) for t in (r, y))
            h = r + y
            # float32 products at full precision only: in bf16, or with TF32 / reduced-precision
            # float32 products, the bound below does not hold (and near ties are everywhere)
            full = (torch.finfo(self.E.dtype).bits >= 32 and torch.get_float32_matmul_precision() == "highest"
                    and not (self.E.device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32))
            ok = full and self._affine(h) is not None
            if ok:
                zhat, tol = self._derive([r, y], [self.logits(r), self.logits(y)], h)
                ok = bool(((zhat - self.logits(h).float()).abs() <= tol / 2).all())
            self._sum_checked = ok
        return self._sum_checked

    def probs(self, h: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.logits(h).float(), -1)


class NaiveLens(Lens):
    """h·E (+ the unembedding's bias), the paper's projection; a direction is v·E."""

    name = "naive"

    @torch.no_grad()
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self._unembed(h.to(self.E.dtype))

    def _direction(self, v: torch.Tensor) -> torch.Tensor:
        return v

    def _affine(self, h):
        return torch.ones(*h.shape[:-1], 1, device=h.device), self._offset(), h

    units = "naive-lens units: m·(v·e_t), no final norm (not the model's logits)"

    @torch.no_grad()
    def logit_scale(self, h: torch.Tensor) -> torch.Tensor:
        """1: h·E is linear, so m·(v·e_t) is already its share of the naive logit."""
        return torch.ones(*h.shape[:-1], 1, device=h.device)


class NormLens(Lens):
    """The model's own head (`model_logits`: final norm, unembedding, and what the family does to
    the logits, e.g. Gemma 2's soft-cap), so the last layer's output gives exactly the model's
    logits. A direction has no scale, so it gets only the final norm's gain (`gain`, e.g. Gemma's
    1 + w), and no soft-cap (monotone: ranks do not move)."""

    name = "norm"

    @torch.no_grad()
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.model_logits(h)

    def _direction(self, v: torch.Tensor) -> torch.Tensor:
        return v * self.gain.to(v.dtype)

    def _head_scale(self) -> float:
        return float(self.mm.arch.head_scale(self.mm.hf.config))

    def _affine(self, h):
        """head_scale / s(h) (`logit_scale`), and head_scale·(β·E + b) from the norm's and the
        unembedding's biases (`_offset`); None under a soft-cap (not affine)."""
        if self.mm.arch.cap(self.mm.hf.config):
            return None
        return self.logit_scale(h), self._offset(), self.final_norm(h.to(self.E.dtype))

    @torch.no_grad()
    def _offset(self):
        """head_scale·(β·E + b), or None without biases: a product with E, made once per lens, not
        once per row batch (`_affine` runs three times per layer in compose)."""
        if "_offset_cache" not in self.__dict__:
            beta = getattr(self.final_norm, "bias", None)
            off = None
            if beta is not None:
                off = self._unembed(beta.detach().to(self.E.dtype)[None])[0].float()
            elif self.bias is not None:
                off = self.bias.detach().float()
            self._offset_cache = None if off is None else off * self._head_scale()
        return self._offset_cache

    @property
    def units(self) -> str:
        cap = " before the soft-cap" if self.mm.arch.softcap else ""
        v, rms = ("(v − mean v)", "std") if self.centres else ("v", "rms")
        return f"logits{cap}: m·({v}·(g⊙e_t))/{rms}(final residual), the scale frozen at this run"

    @property
    def centres(self) -> bool:
        """The final norm subtracts the mean (LayerNorm): a write's share is its centred part's."""
        return self.mm.arch.norm_centres(self.final_norm)

    @torch.no_grad()
    def logit_scale(self, h: torch.Tensor) -> torch.Tensor:
        """head_scale / s, s = sqrt(mean((h − mean h)²) + ε) (LayerNorm) or sqrt(mean(h²) + ε)
        (RMSNorm): the final norm's own scale at h. Frozen at h, the norm is linear, so the shares
        of all writes to h (embedding, attention, each m_i·v_i, biases) add up to the logit, less
        the norm's and unembedding's biases (direct logit attribution, as TransformerLens does it
        with a cached LayerNorm scale). Without it m·(v·(g⊙e_t)) is off by s (issue 48: +1025)."""
        hf = h.float()
        if self.centres:
            hf = hf - hf.mean(-1, keepdim=True)
        eps = self.mm.arch.norm_eps(self.final_norm)
        s = torch.sqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
        return self.mm.arch.head_scale(self.mm.hf.config) / s

    @torch.no_grad()
    def contribution_logits(self, v: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """The direction's logits of the write's centred part where the norm centres."""
        v = v.float()
        if self.centres:
            v = v - v.mean(-1, keepdim=True)
        return self.direction_logits(v, tokens)


LENS_TYPES: dict[str, type[Lens]] = {c.name: c for c in (NaiveLens, NormLens)}
assert tuple(LENS_TYPES) == LENSES


def lens_for(mm: "MemoryModel", name: str) -> Lens:
    """mm's lens `name` ("naive" or "norm"): one instance per model and name, so the run's lens
    (`mm.lens`) and the other one are asked for alike and never built twice."""
    lenses = mm.__dict__.setdefault("_lenses", {})
    if name not in lenses:
        lenses[name] = LENS_TYPES[check_lens(name)](mm)
    return lenses[name]


class MemoryModel:
    """Uniform view of a HF causal LM's FFNs as memories, plus capture hooks."""

    def __init__(self, hf, tokenizer, spec=None, lens: str = "norm"):
        self.hf, self.tok, self.spec = hf, tokenizer, spec
        self.arch: Architecture = find(hf.config, hf)
        self.blocks = get_path(hf, self.arch.layers)
        self.arch.check_blocks(self.blocks)
        self.n_layers = len(self.blocks)
        self._state = [{} for _ in range(self.n_layers)]
        self._values_cache: list = []  # per layer, shared by its hooks (arch.hook_m)
        self.gated = self.arch.up is not None
        self.d_m, self.d = self.arch.dims(self.blocks[0])
        self.lens = lens_for(self, lens)
        self.vocab_size = self.lens.E.shape[0]
        act = self.act(0) if self.arch.act else None
        self.act_name = str(getattr(text_config(hf.config), self.arch.act_config, None) or type(act).__name__)

    @property
    def device(self):
        return self.lens.E.device

    @property
    def dtype(self):
        return self.lens.E.dtype

    # ---- weights, all as (d_m, d) rows (the family's entry in ffkv.model.arch reads them) ------
    def _mod(self, layer: int, path: str):
        return get_path(self.blocks[layer], path)

    def keys(self, layer: int) -> torch.Tensor:
        """K (d_m, d): the gate keys for a gated FFN."""
        return self.arch.keys(self.blocks[layer])

    def up_keys(self, layer: int) -> torch.Tensor | None:
        return self.arch.up_keys(self.blocks[layer])

    def values(self, layer: int) -> torch.Tensor:
        """V (d_m, d): row i is the value v_i written to the residual stream with weight m_i
        (after a post-FFN norm's gain, where the family has one). The last two layers asked for
        are kept while the block's weights stay as they are (a post-FFN norm's V is a product,
        and callers ask for one layer many times)."""
        blk = self.blocks[layer]
        key = (layer, tuple((id(p), p._version) for p in blk.parameters()))
        for k, v in self._values_cache:
            if k == key:
                return v
        with torch.no_grad():
            v = self.arch.values(blk)
        self._values_cache = [(key, v), *self._values_cache[:1]]
        return v

    def expert_of(self, dim: int) -> tuple[int, int] | None:
        """(expert, i) of memory dim `dim` in a mixture-of-experts model (dim = expert·d_expert + i;
        a shared expert is expert n_experts), None for a dense FFN (`ffkv.model.arch.MoE`)."""
        return self.arch.expert_of(self.blocks[0], dim)

    def key_bias(self, layer: int):
        return self.arch.key_bias(self.blocks[layer])

    def up_bias(self, layer: int):
        return self.arch.up_bias(self.blocks[layer])

    def value_bias(self, layer: int):
        return self.arch.value_bias(self.blocks[layer])

    def act(self, layer: int):
        return self.arch.act_fn(self.blocks[layer])

    # ---- the definitions -------------------------------------------------------------------
    @torch.no_grad()
    def coefficients(self, layer: int, x: torch.Tensor, act=None) -> torch.Tensor:
        """m (..., d_m) from the FFN input x (..., d); `act` (e.g. torch.relu) replaces the layer's
        activation, for variants of the FFN (the post-FFN norm's scale then follows the variant's
        own output).

        Gated: m_i = f(x·g_i)·(x·u_i), signed. Otherwise m_i = f(x·k_i + b_i). With a post-FFN
        norm, divided by the token's norm scale s (`ffkv.model.arch.PostNorm`), so that
        Σ_i m_i·v_i is what the FFN adds to the residual stream.
        The capture reads m where the model computes it, and tests hold the two equal.
        """
        return self.arch.coefficients(self.blocks[layer], x, act)

    @torch.no_grad()
    def ffn_from_memories(self, layer: int, m: torch.Tensor) -> torch.Tensor:
        """y = Σ_i m_i·v_i + b: what the FFN adds to the residual stream, rebuilt from its memories."""
        return self.arch.rebuild(self.blocks[layer], m)

    def replace_ffn(self, layer: int, replace, shape) -> list:
        """Hooks (handles) under which layer `layer`'s FFN adds replace(x, m) (B, T, d) instead of
        its own output; `shape` a [B, T] list of the running batch. Returning None keeps it."""
        return self.arch.replace_y(self.blocks[layer], replace, shape, {})

    # ---- tokenization ------------------------------------------------------------------------
    @property
    def max_length(self) -> int:
        cfg = text_config(self.hf.config)
        for a in ("max_position_embeddings", "n_positions", "n_ctx"):
            if getattr(cfg, a, None):
                return int(getattr(cfg, a))
        return 2048

    def pad_id(self) -> int:
        pid = self.tok.pad_token_id
        return int(pid if pid is not None else 0)

    @torch.no_grad()
    def greedy(self, ids: list[int], n: int) -> list[int]:
        """The model's own greedy continuation of token ids `ids`, as it now is (edited or hooked):
        up to n new ids from a plain `generate` (do_sample=False; fewer where it ends its text, none
        past the model's context, where a position has no embedding). The one generation the
        explorer's continuations and the facts' before/after and fluency texts all read."""
        n = min(int(n), self.max_length - len(ids))
        if n <= 0 or not len(ids):
            return []
        x = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        out = self.hf.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                               num_beams=1, pad_token_id=self.pad_id())
        return out[0, len(ids):].tolist()

    def batch(self, seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-pad token id lists into (B, T) ids and mask (`pad_rows`)."""
        lens = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
        flat = np.concatenate([np.asarray(s, dtype=np.int64).reshape(-1) for s in seqs])
        return pad_rows(flat, lens, self.pad_id(), self.device)

    # ---- capture -----------------------------------------------------------------------------
    @torch.no_grad()
    def capture(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                layers=None, what=("m",), logits: bool = False, callback=None, **forward) -> Captures:
        """One forward pass capturing `what` (subset of r, x, m, y, o, g) at `layers`; g (a gated
        FFN's gate pre-activations) comes before m in a layer.

        `forward` is passed on to the model's forward (e.g. position_ids, past_key_values with
        use_cache=True, to continue cached prefixes; `ffkv.memories.rescore` does).

        Stops after the last requested layer unless logits are asked for. With `callback`,
        each captured tensor is handed to callback(layer, name, tensor) instead of kept,
        so a tracker can reduce it at once.
        """
        layers = sorted(set(range(self.n_layers) if layers is None else layers))
        bad = [l for l in layers if not 0 <= l < self.n_layers]
        if bad:
            raise FfkvError(f"layer(s) {bad} out of range 0..{self.n_layers - 1}")
        what = tuple(what)
        unknown = set(what) - set(QUANTITIES)
        if unknown:
            raise FfkvError(f"unknown quantity {sorted(unknown)}; choose from {QUANTITIES}")
        out = Captures()
        need_y = any(q in what for q in ("y", "r"))
        need_o = any(q in what for q in ("o", "r"))
        hooks = []
        store: dict[int, dict[str, torch.Tensor]] = {}
        shape = list(input_ids.shape[:2])  # (B, T), for families that run their FFN on B·T rows
        arch = self.arch

        def emit(layer, name, t):
            if name in what:
                if callback is not None:
                    callback(layer, name, t)
                else:
                    out.layers.setdefault(layer, {})[name] = t

        for l in layers:
            store[l] = {}
            blk = self.blocks[l]
            if "x" in what:
                hooks += arch.hook_x(blk, lambda x, l=l: emit(l, "x", x.detach()), shape)
            if "g" in what:
                hooks += arch.hook_g(blk, lambda g, l=l: emit(l, "g", g.detach()), shape)
            if "m" in what:
                hooks += arch.hook_m(blk, lambda m, l=l: emit(l, "m", m.detach()), shape, self._state[l])
            if need_y:
                def on_y(y, l=l):
                    y = y.detach()
                    store[l]["y"] = y
                    emit(l, "y", y)
                hooks += arch.hook_y(blk, on_y, shape)
            if need_o:
                def on_o(mod, args, res, l=l):
                    o = (res[0] if isinstance(res, tuple) else res).detach()
                    if "r" in what:
                        emit(l, "r", o - store[l]["y"])
                    emit(l, "o", o)
                    store[l].clear()
                hooks.append(blk.register_forward_hook(on_o))
        last = layers[-1]
        if not logits:
            def stop(mod, args, res):
                raise _Stop
            hooks.append(self.blocks[last].register_forward_hook(stop))
        try:
            if logits:
                res = self.hf(input_ids=input_ids, attention_mask=attention_mask,
                              **{"use_cache": False, **forward})
                out.logits = res.logits
            else:
                self.hf(input_ids=input_ids, attention_mask=attention_mask, **{"use_cache": False, **forward})
        except _Stop:
            pass
        finally:
            for h in hooks:
                h.remove()
            self._clear_state()
        return out

    # ---- interventions -----------------------------------------------------------------------
    @contextmanager
    def intervene(self, edits, at: str = "last", last: torch.Tensor | None = None):
        """Within the block, every forward pass runs with chosen memory coefficients edited.

        `edits`: (layer, dim, op, value) items (e.g. `ffkv.parse.Intervention`); op "scale"
        multiplies m_i by value (0 suppresses memory i), "set" replaces m_i by value; a memory
        both scaled and set is scaled first. `at`: "last" edits only the last position of each
        row (T-1, or `last`, (B,) indices, for right-padded batches), "all" every position.

        The edit happens where `capture` reads m (the family's `hook_m`: the value projection's
        input; after a post-FFN norm, its output, the token's norm scale kept), so a capture
        inside the block sees the edited m, and y, o and the logits follow from it.
        """
        if at not in ("last", "all"):
            raise FfkvError(f"intervention position {at!r}: choose last or all")
        per_layer: dict[int, dict[str, list]] = {}
        for layer, dim, op, value in edits:
            if not 0 <= layer < self.n_layers or not 0 <= dim < self.d_m:
                raise FfkvError(f"memory {layer}:{dim} out of range: layers 0..{self.n_layers - 1}, "
                                f"dims 0..{self.d_m - 1}")
            if op not in ("scale", "set"):
                raise FfkvError(f"intervention {op!r}: choose scale or set")
            e = per_layer.setdefault(int(layer), {"scale": ([], []), "set": ([], [])})
            e[op][0].append(int(dim))
            e[op][1].append(float(value))
        shape: list[int] = [0, 0]  # (B, T) of the running forward pass, set by `editing`

        def make(spec):
            sd, sv = (torch.tensor(spec["scale"][0], device=self.device, dtype=torch.long),
                      torch.tensor(spec["scale"][1], device=self.device))
            td, tv = (torch.tensor(spec["set"][0], device=self.device, dtype=torch.long),
                      torch.tensor(spec["set"][1], device=self.device))

            def edit(m):  # m (B, T, d_m)
                B, T = shape
                m3 = m.clone()
                if at == "all":
                    pos = (slice(None), slice(None))
                else:
                    p = (last if last is not None else torch.full((B,), T - 1)).to(m.device).long()
                    pos = (torch.arange(B, device=m.device)[:, None], p[:, None])
                if len(sd):
                    m3[(*pos, sd)] = m3[(*pos, sd)] * sv.to(m.dtype)
                if len(td):
                    m3[(*pos, td)] = tv.to(m.dtype)
                return m3
            return edit

        with self.editing({l: make(spec) for l, spec in per_layer.items()}, shape):
            yield self

    @contextmanager
    def editing(self, fns: dict, shape: list | None = None):
        """Within the block, every forward pass runs with layer l's coefficients replaced by
        fns[l](m) ((B, T, d_m) -> the same, or None to keep m), where `intervene` edits them:
        what interventions, and gradients with respect to m (`ffkv.steps.facts.locate`), share.
        `shape`, if given, is kept as the running pass's (B, T)."""
        shape = [0, 0] if shape is None else shape

        def on_model(mod, args, kwargs):
            x = kwargs.get("input_ids", args[0] if args else None)
            if x is None:
                x = kwargs["inputs_embeds"]
            shape[:] = x.shape[:2]

        hooks = [self.hf.register_forward_pre_hook(on_model, with_kwargs=True)]
        try:
            for l, fn in fns.items():
                hooks += self.arch.hook_m(self.blocks[l], fn, shape, self._state[l])
            yield self
        finally:
            for h in hooks:
                h.remove()
            self._clear_state()

    def _clear_state(self) -> None:
        for st in self._state:
            st.clear()

    def info(self) -> dict:
        return {
            "model": self.spec.model_id if self.spec else type(self.hf).__name__,
            "architecture": self.arch.name,
            "class": type(self.hf).__name__,
            "layers": self.n_layers,
            "d": self.d,
            "d_m": self.d_m,
            "activation": self.act_name,
            "gated": self.gated,
            "post_ffn_norm": getattr(self.arch, "post_norm", None) is not None,
            "memories": self.n_layers * self.d_m,
            **self.arch.moe_info(self.blocks[0]),
            "vocab_size": self.vocab_size,
            "tokenizer_vocab": len(self.tok) if self.tok is not None else None,
            "context": self.max_length,
            "dtype": str(self.dtype).replace("torch.", ""),
            "device": str(self.device),
        }


def open_model(model: str | None = None, device: str = "auto", dtype: str = "auto",
               lens: str = "norm") -> MemoryModel:
    from ffkv.model.load import load_model

    hf, tok, spec = load_model(model, device=device, dtype=dtype)
    return MemoryModel(hf, tok, spec, lens=lens)
