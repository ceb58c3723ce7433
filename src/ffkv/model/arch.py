"""Each architecture's FFN as memories: where it lives, how m and v are read, where hooks sit.

One entry per model type in ARCHITECTURES. An entry carries everything that differs between
families, in one place:
- its checks (`check` on the config, `check_blocks` on the modules: variants of a family that
  the memory view cannot read exactly);
- how coefficients m and values v are read from the weights (`keys`, `up_keys`, `values`,
  `coefficients`) and how the FFN's output is rebuilt from them (`rebuild`);
- where capture and intervention hooks sit (`hook_x`, `hook_m`, `hook_y`, `replace_y`), and where
  causal tracing restores what the FFN and the attention add (`edit_y`, `edit_attn`; `attn` the
  attention module's path);
- how the final norm's gain and the model's own head read a residual state (`norm_gain`, `head`).

A simple family is one line of data (attribute paths, weight layout). A family with real
differences is a small subclass: `OPT` (checks), `FusedGateUp` (Phi-3's fused gate_up_proj),
`PostNorm` (Gemma 2/3, OLMo 2: an RMSNorm after the FFN), `ScaledResidual` (Granite's residual
multiplier and logit divisor), `Falcon` (an in-place add into the FFN's output), `Bloom`
(checks), `MoE` (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE: experts in fused 3D weights, memories
(expert, dim) flattened onto one axis). Nothing else in ffkv branches on the model type.

Hooks: every `hook_*` returns a list of torch hook handles. `shape` is a (B, T) list the caller
keeps up to date (families with `flat=True` run their FFN on (B·T, d) rows); `state` is a dict
per layer that the caller owns, shared by all hooks on that layer (a post-norm family keeps the
token's m there, so that an intervention and a capture on the same layer see the same m).
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from ffkv.errors import FfkvError

if TYPE_CHECKING:  # torch is imported where a method needs it, so that the table of families
    import torch   # (`supported`, a GGUF's refusal) loads without it


def get_path(obj, path: str):
    for part in path.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj


def text_config(cfg):
    """The language model's config (a multimodal config keeps it as its text config)."""
    get = getattr(cfg, "get_text_config", None)
    return get() if get is not None else cfg


@dataclass(frozen=True)
class Architecture:
    """A plain FFN y = Σ_i m_i·v_i + b, added to the residual stream as it is (ReLU/GELU or gated)."""
    name: str
    layers: str  # path from the CausalLM to the list of decoder blocks
    final_norm: str  # path from the CausalLM to the final norm
    unembed: str  # fallback path to the output projection; get_output_embeddings() comes first
    # Paths inside one block. For gated FFNs `key` is the gate projection, `up` the up projection.
    key: str
    value: str
    up: str | None = None
    act: str | None = None  # path inside the block to the activation module (None: from config)
    # "linear": weight stored out x in (nn.Linear). "conv1d": in x out (GPT-2's Conv1D).
    layout: str = "linear"
    act_config: str = "hidden_act"  # config attribute naming the activation
    gain_offset: float = 0.0  # an RMSNorm's gain is offset + weight (Gemma: 1 + w)
    softcap: str | None = None  # config attribute of the final logits' tanh soft-cap (Gemma 2)
    flat: bool = False  # the FFN runs on (B·T, d) rows (OPT)
    attn: str = "self_attn"  # path inside the block to the attention module (`edit_attn`)

    # ---- checks ------------------------------------------------------------------------------
    def check(self, cfg) -> None:
        """Raise FfkvError for a variant of this family the memory view cannot read exactly."""

    def check_blocks(self, blocks) -> None:
        """The same, for what only the built modules tell."""

    # ---- weights, all as (d_m, d) rows -------------------------------------------------------
    def module(self, blk, path: str):
        return get_path(blk, path)

    def _rows(self, w: torch.Tensor) -> torch.Tensor:
        """An input projection's weight as (d_m, d) rows."""
        return w.T if self.layout == "conv1d" else w

    def keys(self, blk) -> torch.Tensor:
        """K (d_m, d): the gate keys for a gated FFN."""
        return self._rows(self.module(blk, self.key).weight)

    def up_keys(self, blk) -> torch.Tensor | None:
        return self._rows(self.module(blk, self.up).weight) if self.up else None

    def key_bias(self, blk):
        return getattr(self.module(blk, self.key), "bias", None)

    def up_bias(self, blk):
        return getattr(self.module(blk, self.up), "bias", None) if self.up else None

    def value_weight(self, blk) -> torch.Tensor:
        """The value projection's weight as (d_m, d) rows: what memory i writes before any
        scale or norm that follows the FFN."""
        w = self.module(blk, self.value).weight
        return w if self.layout == "conv1d" else w.T

    def values(self, blk) -> torch.Tensor:
        """V (d_m, d): row i is the value v_i, written to the residual stream with weight m_i."""
        return self.value_weight(blk)

    def value_bias(self, blk):
        """b (d,) added to the residual stream whatever the coefficients, or None."""
        return getattr(self.module(blk, self.value), "bias", None)

    def value_param(self, blk) -> torch.Tensor:
        """The value projection's weight parameter itself (what an edit changes and restores)."""
        return self.module(blk, self.value).weight

    def add_values(self, blk, delta: torch.Tensor) -> None:
        """V += delta (d_m, d) in the weights (a fact edit, `ffkv.steps.facts.edit`): the raw
        weight moves by what makes `values` move by delta."""
        self.value_weight(blk).add_(self.raw_values(blk, delta).to(self.value_param(blk).dtype))

    def raw_values(self, blk, delta: torch.Tensor) -> torch.Tensor:
        """A change of V as the change of the value projection's rows that gives it."""
        return delta

    def act_fn(self, blk):
        return self.module(blk, self.act)

    def dims(self, blk) -> tuple[int, int]:
        """(d_m, d): the layer's number of memories and the residual stream's width."""
        return tuple(self.keys(blk).shape)

    def expert_of(self, blk, dim: int) -> tuple[int, int] | None:
        """(expert, i) of a memory dim in a mixture of experts; None for a dense FFN."""
        return None

    def moe_info(self, blk) -> dict:
        """What a run's manifest records of a mixture of experts ({} for a dense FFN)."""
        return {}

    # ---- the definitions ---------------------------------------------------------------------
    def activations(self, blk, x: torch.Tensor, act=None) -> torch.Tensor:
        """The value projection's input (..., d_m) from the FFN input x (..., d):
        f(x·k_i + b_i), or f(x·g_i)·(x·u_i) for a gated FFN; f the layer's own activation, or
        `act` in its place."""
        pre = x @ self.keys(blk).T
        if self.key_bias(blk) is not None:
            pre = pre + self.key_bias(blk)
        a = (act or self.act_fn(blk))(pre)
        if self.up:
            up = x @ self.up_keys(blk).T
            if self.up_bias(blk) is not None:
                up = up + self.up_bias(blk)
            a = a * up
        return a

    def coefficients(self, blk, x: torch.Tensor, act=None) -> torch.Tensor:
        """m (..., d_m) from the FFN input x (..., d) (`act`: another activation in place of f)."""
        return self.activations(blk, x, act)

    def rebuild(self, blk, m: torch.Tensor) -> torch.Tensor:
        """y = Σ_i m_i·v_i + b: what the FFN adds to the residual stream."""
        y = m @ self.values(blk)
        b = self.value_bias(blk)
        return y + b if b is not None else y

    # ---- the lens ----------------------------------------------------------------------------
    def norm_gain(self, norm) -> torch.Tensor | None:
        """The gain a norm multiplies its normalised input by, or None for none."""
        w = getattr(norm, "weight", None)
        return None if w is None else w + self.gain_offset if self.gain_offset else w

    @staticmethod
    def norm_eps(norm) -> float:
        """A norm's ε. OLMo's parameter-free LayerNorm keeps none: it hard-codes F.layer_norm's 1e-5."""
        eps = getattr(norm, "eps", getattr(norm, "variance_epsilon", None))
        return 1e-5 if eps is None else float(eps)

    @staticmethod
    def norm_centres(norm) -> bool:
        """Whether a norm subtracts the mean (a LayerNorm) or not (an RMSNorm), from its class."""
        import torch

        name = type(norm).__name__
        return isinstance(norm, torch.nn.LayerNorm) or ("LayerNorm" in name and "RMS" not in name)

    def head_scale(self, cfg) -> float:
        """The linear factor of `head` (what the logits are multiplied by); a soft-cap is not
        linear and is left out: attributions are then in logits before it."""
        return 1.0

    def cap(self, cfg) -> float | None:
        """The final logits' soft-cap this model's config sets, or None (the family has none, or
        this model turns it off)."""
        return (getattr(text_config(cfg), self.softcap, None) if self.softcap else None) or None

    def head(self, cfg, z: torch.Tensor) -> torch.Tensor:
        """What the CausalLM does to the unembedded final state, here a soft-cap if any."""
        cap = self.cap(cfg)
        if not cap:
            return z
        import torch

        return torch.tanh(z / cap) * cap

    # ---- hook sites --------------------------------------------------------------------------
    def _tokens(self, t: torch.Tensor, shape) -> torch.Tensor:
        return t.view(*shape, t.shape[-1]) if self.flat else t

    def y_site(self, blk):
        """The module whose output is (up to `read_y`) what the FFN adds to the residual stream."""
        return self.module(blk, self.value)

    def read_y(self, blk, out: torch.Tensor) -> torch.Tensor:
        """What the FFN adds, from the y site's output."""
        return out

    def write_y(self, blk, y: torch.Tensor) -> torch.Tensor:
        """The y site's output that makes the FFN add y (the inverse of `read_y`)."""
        return y

    def hook_x(self, blk, fn: Callable, shape) -> list:
        """fn(x) on the FFN input x (B, T, d)."""
        return [self.module(blk, self.key).register_forward_pre_hook(
            lambda mod, args: fn(self._tokens(args[0], shape)))]

    def gate_refusal(self) -> str | None:
        """Why `hook_g` cannot read this family's gate pre-activations (None: it can)."""
        return None if self.up else "needs a gated FFN (its memories have no gate)"

    def gate_out(self, out: torch.Tensor) -> torch.Tensor:
        """The gate pre-activations (..., d_m) from the gate projection's output."""
        return out

    def hook_g(self, blk, fn: Callable, shape) -> list:
        """fn(g) on a gated FFN's gate pre-activations g (B, T, d_m), g_i = x·g_i (+ bias), as the
        model computes them and hands them to its activation: the gate projection's output
        (`ffkv.mine.regimes` reads their signs)."""
        why = self.gate_refusal()
        if why:
            raise FfkvError(f"{self.name}: {why}")
        return [self.module(blk, self.key).register_forward_hook(
            lambda mod, args, out: fn(self._tokens(self.gate_out(out), shape)))]

    def hook_m(self, blk, fn: Callable, shape, state: dict) -> list:
        """fn(m) on the coefficients m (B, T, d_m) as the model computes them; when fn returns a
        tensor, the model goes on with it in place of m. Here: the value projection's input."""
        def pre(mod, args):
            m = args[0]
            new = fn(self._tokens(m, shape))
            return None if new is None else (new.reshape(m.shape), *args[1:])
        return [self.module(blk, self.value).register_forward_pre_hook(pre)]

    @staticmethod
    def edit_after(state: dict, fn: Callable, out: torch.Tensor, write: Callable):
        """fn(m) at an output `out` that m (kept in `state`) has already made: an edit m' adds
        write(m' − m) = Σ_i (m'_i − m_i)·v_i to it (None: out stays). The edit replaces m in
        `state`, so a later fn on the same output (a capture) sees it (an intervention's)."""
        m = state["m"]
        new = fn(m)
        if new is None:
            return None
        state["m"] = new
        add = write(new - m)
        return None if add is None else out + add.reshape(out.shape).to(out.dtype)

    def hook_y(self, blk, fn: Callable, shape) -> list:
        """fn(y) on what the FFN adds to the residual stream, y (B, T, d)."""
        return [self.y_site(blk).register_forward_hook(
            lambda mod, args, out: fn(self._tokens(self.read_y(blk, out), shape)))]

    def edit_y(self, blk, fn: Callable, shape) -> list:
        """fn(y) on what the FFN adds to the residual stream, y (B, T, d); a tensor it returns is
        added in y's place (None keeps y). Causal tracing restores a clean y so."""
        def swap(mod, args, out):
            new = fn(self._tokens(self.read_y(blk, out), shape))
            return None if new is None else self.write_y(blk, new).reshape(out.shape).to(out.dtype)
        return [self.y_site(blk).register_forward_hook(swap)]

    def read_attn(self, args, kwargs, out) -> torch.Tensor:
        """The attention module's output a (B, T, d), from its hook's arguments and output: what
        the block adds to the residual stream for it, up to a map per token that follows (a
        post-attention norm, a residual multiplier), so that a restored a at a token restores what
        is added there."""
        return out[0] if isinstance(out, tuple) else out

    def write_attn(self, args, kwargs, out, a: torch.Tensor):
        """The attention module's output that makes it give a (the inverse of `read_attn`)."""
        a = a.to((out[0] if isinstance(out, tuple) else out).dtype)
        return (a, *out[1:]) if isinstance(out, tuple) else a

    def edit_attn(self, blk, fn: Callable, shape) -> list:
        """fn(a) on the attention block's output a (B, T, d) (`read_attn`); a tensor it returns
        takes a's place (None keeps it)."""
        def swap(mod, args, kwargs, out):
            new = fn(self.read_attn(args, kwargs, out))
            return None if new is None else self.write_attn(args, kwargs, out, new)
        return [self.module(blk, self.attn).register_forward_hook(swap, with_kwargs=True)]

    def replace_y(self, blk, replace: Callable, shape, state: dict) -> list:
        """The FFN adds replace(x, m) (B, T, d) instead of its own y (None keeps y)."""
        seen: dict = {}

        def keep_m(m):
            seen["m"] = m

        def swap(mod, args, out):
            y = replace(seen.pop("x"), seen.pop("m"))
            return None if y is None else self.write_y(blk, y).reshape(out.shape).to(out.dtype)

        return (self.hook_x(blk, lambda x: seen.__setitem__("x", x), shape)
                + self.hook_m(blk, keep_m, shape, state)
                + [self.y_site(blk).register_forward_hook(swap)])


@dataclass(frozen=True)
class OPT(Architecture):
    """OPT runs its FFN on (B·T, d) rows; two variants do not fit the memory view."""
    flat: bool = True

    def check(self, cfg) -> None:
        if not getattr(cfg, "do_layer_norm_before", True):
            raise FfkvError("post-norm OPT (e.g. opt-350m) is not supported: its FFN output is "
                            "normalised after the residual add, so o = y + r does not hold")
        if getattr(cfg, "word_embed_proj_dim", cfg.hidden_size) != cfg.hidden_size:
            raise FfkvError("OPT with project_out (word_embed_proj_dim != hidden_size) is not supported")


@dataclass(frozen=True)
class FusedGateUp(Architecture):
    """Gate and up projections fused into one matrix (`key` = `up`): rows [0, d_m) are the gate
    keys, rows [d_m, 2·d_m) the up keys (Phi-3: gate, up = gate_up_proj(x).chunk(2))."""

    def _half(self, t, i: int):
        if t is None:
            return None
        n = t.shape[0] // 2
        return t[i * n:(i + 1) * n]

    def keys(self, blk):
        return self._half(self.module(blk, self.key).weight, 0)

    def up_keys(self, blk):
        return self._half(self.module(blk, self.key).weight, 1)

    def key_bias(self, blk):
        return self._half(getattr(self.module(blk, self.key), "bias", None), 0)

    def up_bias(self, blk):
        return self._half(getattr(self.module(blk, self.key), "bias", None), 1)

    def gate_out(self, out):
        return out[..., :out.shape[-1] // 2]  # gate, up = gate_up_proj(x).chunk(2, dim=-1)


@dataclass(frozen=True)
class PostNorm(Architecture):
    """The FFN's output u = Σ_i a_i·w_i (a the value projection's input, w_i its columns) passes
    an RMSNorm before the residual add: y = g ⊙ u / s, s = sqrt(mean(u²) + ε) the token's scale,
    g the norm's gain. Once s is fixed the norm is linear, so

        y = Σ_i m_i·v_i,   v_i = g ⊙ w_i (the direction memory i writes, after the gain),
                           m_i = a_i / s (the token's scale belongs to the coefficient).

    Captures and interventions work on this m: an intervention changes what the FFN adds by
    Σ_i (m'_i − m_i)·v_i, the token's scale s staying as the model computed it."""
    post_norm: str = "post_feedforward_layernorm"  # path inside the block

    def check_blocks(self, blocks) -> None:
        for blk in blocks:
            norm = self.module(blk, self.post_norm)
            if getattr(self.module(blk, self.value), "bias", None) is not None:
                raise FfkvError(f"{self.name} with a value-projection bias is not supported: a bias "
                                "before the post-FFN norm is not a memory")
            if getattr(norm, "bias", None) is not None or self._eps(norm) is None:
                raise FfkvError(f"{self.name}'s post-FFN norm {type(norm).__name__} is not an RMSNorm "
                                "ffkv can split into a token scale and a gain")

    @staticmethod
    def _eps(norm):
        return getattr(norm, "eps", getattr(norm, "variance_epsilon", None))

    def value_bias(self, blk):
        return None

    def values(self, blk):
        g = self.norm_gain(self.module(blk, self.post_norm))
        w = self.value_weight(blk)
        return w if g is None else w * g.to(w.dtype)

    def raw_values(self, blk, delta):
        """delta / g, and 0 where the gain is 0 (Gemma 3 270M's layer 4 has 7 such dims): every value
        is 0 there, so no change of the weights can move them (a division made them inf, and the
        edited model's logits NaN)."""
        import torch

        g = self.norm_gain(self.module(blk, self.post_norm))
        if g is None:
            return delta
        g = g.to(delta.dtype)
        return torch.where(g != 0, delta / torch.where(g != 0, g, 1), torch.zeros((), dtype=delta.dtype))

    def inv_scale(self, blk, u: torch.Tensor) -> torch.Tensor:
        """1/s (..., 1) for the FFN's raw output u (..., d), as the post-FFN RMSNorm computes it."""
        import torch

        uf = u.float()
        eps = self._eps(self.module(blk, self.post_norm))
        return torch.rsqrt(uf.pow(2).mean(-1, keepdim=True) + eps).to(u.dtype)

    def coefficients(self, blk, x, act=None):
        a = self.activations(blk, x, act)
        return a * self.inv_scale(blk, a @ self.value_weight(blk))

    def y_site(self, blk):
        return self.module(blk, self.post_norm)

    def hook_m(self, blk, fn, shape, state):
        """m = a/s is whole only once the value projection has run (s needs its output), so m
        is read there and kept in `state`; fn runs at the post-FFN norm's output, where an edit
        adds Σ_i (m'_i − m_i)·v_i. Hooks on one module run in the order registered, so a later
        fn (a capture) sees an earlier one's edit (an intervention)."""
        def on_value(mod, args, out):
            state["m"] = args[0] * self.inv_scale(blk, out)

        def on_norm(mod, args, out):
            return self.edit_after(state, fn, out, lambda delta: delta @ self.values(blk))

        return [self.module(blk, self.value).register_forward_hook(on_value),
                self.module(blk, self.post_norm).register_forward_hook(on_norm),
                blk.register_forward_hook(lambda mod, args, out: state.clear())]


@dataclass(frozen=True)
class ScaledResidual(Architecture):
    """The block adds the FFN's output times a constant (Granite: residual_multiplier), and the
    head divides the logits by another (logits_scaling). v_i = c·w_i, so Σ m_i·v_i is what the
    FFN adds; the value projection's output is y / c."""
    multiplier: str = "residual_multiplier"
    divisor: str = "logits_scaling"

    def _c(self, blk) -> float:
        return float(getattr(blk, self.multiplier))

    def values(self, blk):
        return self.value_weight(blk) * self._c(blk)

    def raw_values(self, blk, delta):
        return delta / self._c(blk)

    def value_bias(self, blk):
        b = super().value_bias(blk)
        return None if b is None else b * self._c(blk)

    def read_y(self, blk, out):
        return out * self._c(blk)

    def write_y(self, blk, y):
        return y / self._c(blk)

    def _divisor(self, cfg) -> float:
        return float(getattr(text_config(cfg), self.divisor, 1.0) or 1.0)

    def head_scale(self, cfg) -> float:
        return 1.0 / self._divisor(cfg)

    def head(self, cfg, z):
        return z / self._divisor(cfg)


@dataclass(frozen=True)
class Bloom(Architecture):
    """BLOOM with pretraining_tp > 1 and slow_but_exact computes its value projection in slices,
    without calling the module the hooks sit on."""

    def check(self, cfg) -> None:
        if getattr(cfg, "pretraining_tp", 1) > 1 and getattr(cfg, "slow_but_exact", False):
            raise FfkvError("BLOOM with slow_but_exact and pretraining_tp > 1 is not supported: its "
                            "FFN output is computed in slices outside the value projection")

    # BLOOM's attention module adds the residual it is given (its second argument) to its output
    @staticmethod
    def _residual(args, kwargs):
        return args[1] if len(args) > 1 else kwargs["residual"]

    def read_attn(self, args, kwargs, out):
        return super().read_attn(args, kwargs, out) - self._residual(args, kwargs)

    def write_attn(self, args, kwargs, out, a):
        return super().write_attn(args, kwargs, out, a + self._residual(args, kwargs))


@dataclass(frozen=True)
class Falcon(Architecture):
    """Falcon's parallel blocks add the attention's output into the FFN's output tensor in place
    (`mlp_output += attention_output`), so y is copied when read."""

    def read_y(self, blk, out):
        return out.clone()


@dataclass(frozen=True)
class MoE(Architecture):
    """A mixture-of-experts FFN: a router sends each token to its top-k experts, each a gated FFN,
    whose outputs add up weighted by the router (transformers 5 keeps the experts' weights as fused
    3D tensors: `gate_up_proj` (E, 2·d_e, d), gate rows first, and `down_proj` (E, d, d_e); no
    module per expert). A memory is (expert e, dim i), flattened onto one axis:
    dim = e·d_e + i, and a shared expert (Qwen2-MoE) comes after the routed ones, as expert E, its
    d_s dims at E·d_e + i. `expert_of` maps a dim back.

        m_(e,i) = w_e(x)·f(x·g_(e,i))·(x·u_(e,i))   (w_e the router's weight of e at the token,
                                                   0 on tokens not routed to e; for the shared
                                                   expert its sigmoid gate σ(x·s))
        v_(e,i) = column i of expert e's down projection

    so Σ m·v is the MoE block's output. The model never forms m: it is recomputed from the block's
    input x (the router's choice as the family makes it: softmax, top-k, renormalised where
    `norm_topk` says), batched by expert. Captures read it at the block's input; interventions and
    replacements add Σ (m' − m)·v to the block's output."""
    key: str = "mlp.experts"
    value: str = "mlp.experts"
    up: str | None = "mlp.experts"
    act: str | None = "mlp.experts.act_fn"
    block: str = "mlp"  # the MoE block: its input is x, its output y
    router: str = "mlp.gate"  # weight (E, d)
    shared: str | None = None  # a gated MLP every token passes (gate_proj, up_proj, down_proj)
    shared_gate: str | None = None  # Linear(d, 1): the shared expert's weight is σ(x·s)
    # renormalise the top-k weights: True always (Mixtral), None as the router's norm_topk_prob says
    # (set from the config's norm_topk_prob)
    norm_topk: bool | None = True
    sparse_step: bool = False  # the config may make some layers dense (decoder_sparse_step, mlp_only_layers)

    # ---- checks ------------------------------------------------------------------------------
    def check(self, cfg) -> None:
        cfg = text_config(cfg)
        if self.sparse_step and (getattr(cfg, "mlp_only_layers", None)
                                 or getattr(cfg, "decoder_sparse_step", 1) != 1):
            raise FfkvError(f"{self.name} with dense layers among its MoE ones (mlp_only_layers, "
                            "decoder_sparse_step != 1) is not supported: every layer must have the same memories")

    def check_blocks(self, blocks) -> None:
        shapes = set()
        for blk in blocks:
            try:
                ex = self.module(blk, self.key)
            except AttributeError:
                ex = None
            if not hasattr(ex, "gate_up_proj") or not hasattr(ex, "down_proj"):
                raise FfkvError(f"{self.name}: a layer without fused experts "
                                f"({type(self.module(blk, self.block)).__name__}) is not supported")
            shapes.add(self.dims(blk))
            if self.norm_topk is None and not hasattr(self.module(blk, self.router), "norm_topk_prob"):
                raise FfkvError(f"{self.name}: the router has no norm_topk_prob")
            if getattr(ex, "is_transposed", False) or not getattr(ex, "is_concatenated", True) \
                    or getattr(ex, "has_bias", False) or not getattr(ex, "has_gate", True):
                raise FfkvError(f"{self.name}: experts stored transposed, interleaved or with biases "
                                "are not supported")
        if len(shapes) > 1:
            raise FfkvError(f"{self.name} with layers of different expert shapes {sorted(shapes)} is not "
                            "supported: every layer must have the same memories")

    # ---- the experts' layout -----------------------------------------------------------------
    def experts(self, blk):
        return self.module(blk, self.key)

    def dims(self, blk):
        return (self.n_experts(blk) * self.d_expert(blk) + self.d_shared(blk),
                int(self.experts(blk).down_proj.shape[1]))

    def n_experts(self, blk) -> int:
        return int(self.experts(blk).gate_up_proj.shape[0])

    def d_expert(self, blk) -> int:
        return int(self.experts(blk).down_proj.shape[-1])

    def d_shared(self, blk) -> int:
        return int(self.module(blk, self.shared).down_proj.weight.shape[1]) if self.shared else 0

    def top_k(self, blk) -> int:
        return int(self.module(blk, self.router).top_k)

    def expert_of(self, blk, dim: int) -> tuple[int, int]:
        """(expert, i) of a memory dim; the shared expert is expert E."""
        E, de = self.n_experts(blk), self.d_expert(blk)
        dim = int(dim)
        if not 0 <= dim < E * de + self.d_shared(blk):
            raise FfkvError(f"dim {dim} out of range 0..{E * de + self.d_shared(blk) - 1}")
        return (dim // de, dim % de) if dim < E * de else (E, dim - E * de)

    def moe_info(self, blk) -> dict:
        E, de, ds, k = self.n_experts(blk), self.d_expert(blk), self.d_shared(blk), self.top_k(blk)
        # d_m counts every expert's memories; a token reaches memories_per_token of them
        return {"experts": E, "experts_per_token": k, "d_expert": de, "d_shared_expert": ds or None,
                "memories_per_token": k * de + ds, "norm_topk_prob": self._normalise(blk)}

    def _normalise(self, blk) -> bool:
        if self.norm_topk is not None:
            return self.norm_topk
        return bool(self.module(blk, self.router).norm_topk_prob)

    # ---- weights, all as (d_m, d) rows -------------------------------------------------------
    def _cat(self, routed: torch.Tensor, blk, shared: str) -> torch.Tensor:
        import torch

        rows = routed.reshape(-1, routed.shape[-1])
        if self.shared:
            rows = torch.cat([rows, getattr(self.module(blk, self.shared), shared).weight])
        return rows

    def keys(self, blk):
        ex = self.experts(blk)
        return self._cat(ex.gate_up_proj[:, :self.d_expert(blk)], blk, "gate_proj")

    def up_keys(self, blk):
        ex = self.experts(blk)
        return self._cat(ex.gate_up_proj[:, self.d_expert(blk):], blk, "up_proj")

    def activations(self, blk, x, act=None):
        return self.coefficients(blk, x, act)

    def key_bias(self, blk):
        return None

    def up_bias(self, blk):
        return None

    def value_bias(self, blk):
        return None

    def value_weight(self, blk):
        import torch

        rows = self.experts(blk).down_proj.transpose(1, 2).reshape(-1, self.experts(blk).down_proj.shape[1])
        if self.shared:
            rows = torch.cat([rows, self.module(blk, self.shared).down_proj.weight.T])
        return rows

    def value_rows(self, blk, dims: torch.Tensor) -> torch.Tensor:
        """V[dims] (n, d) without forming V (the fused weights read in place)."""
        E, de = self.n_experts(blk), self.d_expert(blk)
        dn = self.experts(blk).down_proj  # (E, d, d_e)
        routed = dims < E * de
        out = dn.new_empty(len(dims), dn.shape[1])
        r = dims[routed]
        out[routed] = dn[r // de, :, r % de]
        if self.shared and (~routed).any():
            out[~routed] = self.module(blk, self.shared).down_proj.weight.T[dims[~routed] - E * de]
        return out

    # ---- the definitions ---------------------------------------------------------------------
    def route(self, blk, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The router's choice for tokens x2 (N, d): weights (N, k) float32 and experts (N, k), as
        the family computes them: softmax over all experts, top-k, renormalised to sum 1 where
        the family does."""
        import torch

        logits = torch.nn.functional.linear(x2, self.module(blk, self.router).weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        w, idx = torch.topk(probs, self.top_k(blk), dim=-1)
        if self._normalise(blk):
            w = w / w.sum(dim=-1, keepdim=True)
        return w, idx

    def terms(self, blk, x: torch.Tensor, act=None, gate: bool = False) -> dict[str, torch.Tensor]:
        """{"m": m, and with `gate` "g": the gate pre-activations} (..., d_m) from the MoE block's
        input x (..., d): one routing (`route`), batched by expert. g_(e,i) = x·g_(e,i) (the first
        d_e rows of gate_up_proj[e]) on the tokens routed to e, 0 on the others (m is 0 there too);
        the shared expert's g is its gate_proj(x) on every token. g is the very gate m is made of."""
        import torch

        ex = self.experts(blk)
        f = act or ex.act_fn
        E, de, ds = self.n_experts(blk), self.d_expert(blk), self.d_shared(blk)
        x2 = x.reshape(-1, x.shape[-1])
        w, idx = self.route(blk, x2)
        m = x2.new_zeros(x2.shape[0], E * de + ds)
        g = x2.new_zeros(x2.shape[0], E * de + ds) if gate else None
        for e in range(E):
            tok, slot = torch.nonzero(idx == e, as_tuple=True)
            if len(tok) == 0:
                continue
            xe = x2[tok]
            ge, up = torch.nn.functional.linear(xe, ex.gate_up_proj[e]).chunk(2, dim=-1)
            m[tok, e * de:(e + 1) * de] = f(ge) * up * w[tok, slot, None].to(x2.dtype)
            if gate:
                g[tok, e * de:(e + 1) * de] = ge
        if self.shared:
            sh = self.module(blk, self.shared)
            s = torch.sigmoid(self.module(blk, self.shared_gate)(x2))
            gs = sh.gate_proj(x2)
            m[:, E * de:] = (act or sh.act_fn)(gs) * sh.up_proj(x2) * s
            if gate:
                g[:, E * de:] = gs
        out = {"m": m} if g is None else {"m": m, "g": g}
        return {k: v.view(*x.shape[:-1], E * de + ds) for k, v in out.items()}

    def coefficients(self, blk, x: torch.Tensor, act=None) -> torch.Tensor:
        """m (..., d_m) from the MoE block's input x (..., d), batched by expert (`terms`)."""
        return self.terms(blk, x, act)["m"]

    def rebuild(self, blk, m):
        """Σ_(e,i) m_(e,i)·v_(e,i), expert by expert from the fused weights (no V formed)."""
        import torch

        E, de = self.n_experts(blk), self.d_expert(blk)
        dn = self.experts(blk).down_proj  # (E, d, d_e)
        y = torch.einsum("...ei,edi->...d", m[..., :E * de].unflatten(-1, (E, de)), dn.to(m.dtype))
        if self.shared:
            y = y + m[..., E * de:] @ self.module(blk, self.shared).down_proj.weight.T.to(m.dtype)
        return y

    # ---- hook sites: the MoE block's input and output ------------------------------------------
    def y_site(self, blk):
        return self.module(blk, self.block)

    def hook_x(self, blk, fn, shape):
        return [self.module(blk, self.block).register_forward_pre_hook(lambda mod, args: fn(args[0]))]

    def hook_g(self, blk, fn, shape):
        """fn(g) on the gate pre-activations g (B, T, d_m) (`terms`: x·g_(e,i) on the tokens routed
        to e, 0 elsewhere; the shared expert's on every token), recomputed from the block's input,
        as m is (`hook_m`). The sign rule of `ffkv.mine.regimes` holds: the router's weight and the
        shared expert's sigmoid gate are positive, so sign(m) = sign(f(g))·sign(u) wherever m ≠ 0.
        The routing runs again here (hooks hold no state in common with `hook_m`'s)."""
        def pre(mod, args):  # returns None: the block's input stays
            fn(self.terms(blk, args[0], gate=True)["g"])

        return [self.module(blk, self.block).register_forward_pre_hook(pre)]

    def hook_m(self, blk, fn, shape, state):
        """m is computed once per forward from the block's input (kept in `state`, which every
        hook on the layer shares); fn runs at the block's output, where an edit m' adds
        Σ (m' − m)·v over the dims it changed. Hooks on one module run in the order registered, so
        a later fn (a capture) sees an earlier one's edit (an intervention)."""
        import torch

        def on_in(mod, args):
            if "m" not in state:
                state["m"] = self.coefficients(blk, args[0])

        def write(delta):  # only the dims the edit changed
            delta = delta.reshape(-1, delta.shape[-1])
            dims = torch.nonzero(delta.ne(0).any(0), as_tuple=True)[0]
            if len(dims) == 0:
                return None
            return delta[:, dims] @ self.value_rows(blk, dims).to(delta.dtype)

        def on_out(mod, args, out):
            return self.edit_after(state, fn, out, write)

        def done(mod, args, out):  # returns None: the block's output stays
            state.pop("m", None)

        return [self.module(blk, self.block).register_forward_pre_hook(on_in),
                self.module(blk, self.block).register_forward_hook(on_out),
                blk.register_forward_hook(done)]


_MODEL = dict(layers="model.layers", final_norm="model.norm", unembed="lm_head")
_LLAMA = dict(**_MODEL,
              key="mlp.gate_proj", up="mlp.up_proj", value="mlp.down_proj", act="mlp.act_fn")

ARCHITECTURES: dict[str, Architecture] = {
    "gpt2": Architecture(
        "gpt2", layers="transformer.h", final_norm="transformer.ln_f", unembed="lm_head",
        key="mlp.c_fc", value="mlp.c_proj", act="mlp.act", layout="conv1d",
        act_config="activation_function", attn="attn"),
    "gpt_neox": Architecture(
        "gpt_neox", layers="gpt_neox.layers", final_norm="gpt_neox.final_layer_norm",
        unembed="lm_head", key="mlp.dense_h_to_4h", value="mlp.dense_4h_to_h", act="mlp.act",
        attn="attention"),
    "opt": OPT(
        "opt", layers="model.decoder.layers", final_norm="model.decoder.final_layer_norm",
        unembed="lm_head", key="fc1", value="fc2", act="activation_fn",
        act_config="activation_function"),
    "llama": Architecture("llama", **_LLAMA),
    # Gemma: (1 + w) RMSNorm gains; Gemma 2 and 3 add a post-FFN norm and Gemma 2 soft-caps.
    "gemma": Architecture("gemma", **_LLAMA, gain_offset=1.0),
    "gemma2": PostNorm("gemma2", **_LLAMA, gain_offset=1.0, softcap="final_logit_softcapping",
                       act_config="hidden_activation"),
    "gemma3_text": PostNorm("gemma3_text", **_LLAMA, gain_offset=1.0, softcap="final_logit_softcapping",
                            act_config="hidden_activation"),
    # Gemma 3 with its vision tower: the language model inside; its head applies no soft-cap
    "gemma3": PostNorm("gemma3", **{**_LLAMA, "layers": "model.language_model.layers",
                                    "final_norm": "model.language_model.norm"},
                       gain_offset=1.0, act_config="hidden_activation"),
    "olmo2": PostNorm("olmo2", **_LLAMA),  # no norm before the FFN, an RMSNorm after it
    "phi3": FusedGateUp("phi3", **{**_LLAMA, "key": "mlp.gate_up_proj", "up": "mlp.gate_up_proj",
                                   "act": "mlp.activation_fn"}),
    # Phi-1/2, GPT-J (and Falcon, StableLM, GPT-NeoX by config): attention and FFN in parallel,
    # both added to the block's input; what the FFN adds is still y (r = o − y then holds the
    # attention's output too).
    "phi": Architecture("phi", layers="model.layers", final_norm="model.final_layernorm", unembed="lm_head",
                        key="mlp.fc1", value="mlp.fc2", act="mlp.activation_fn"),
    "gptj": Architecture("gptj", layers="transformer.h", final_norm="transformer.ln_f", unembed="lm_head",
                         key="mlp.fc_in", value="mlp.fc_out", act="mlp.act",
                         act_config="activation_function", attn="attn"),
    "starcoder2": Architecture("starcoder2", layers="model.layers", final_norm="model.norm", unembed="lm_head",
                               key="mlp.c_fc", value="mlp.c_proj", act="mlp.act"),
    "granite": ScaledResidual("granite", **_LLAMA),
    "falcon": Falcon("falcon", layers="transformer.h", final_norm="transformer.ln_f", unembed="lm_head",
                     key="mlp.dense_h_to_4h", value="mlp.dense_4h_to_h", act="mlp.act",
                     act_config="activation", attn="self_attention"),
    "bloom": Bloom("bloom", layers="transformer.h", final_norm="transformer.ln_f", unembed="lm_head",
                   key="mlp.dense_h_to_4h", value="mlp.dense_4h_to_h", act="mlp.gelu_impl",
                   attn="self_attention"),
    # mixture of experts: memories (expert, dim) flattened, dim = expert·d_expert + i (`MoE`)
    "mixtral": MoE("mixtral", **_MODEL),  # top-k weights always renormalised
    "qwen2_moe": MoE("qwen2_moe", **_MODEL, shared="mlp.shared_expert", shared_gate="mlp.shared_expert_gate",
                     norm_topk=None, sparse_step=True),
    "qwen3_moe": MoE("qwen3_moe", **_MODEL, norm_topk=None, sparse_step=True),
    "olmoe": MoE("olmoe", **_MODEL, norm_topk=None),
}
# Llama-shaped FFNs (gated, or plain with the same paths) under other names share the same layout.
for _alias in ("mistral", "qwen2", "qwen3", "olmo", "stablelm"):
    ARCHITECTURES[_alias] = Architecture(**{**ARCHITECTURES["llama"].__dict__, "name": _alias})


def _layout_match(model) -> str | None:
    """The first entry whose paths (blocks, key, value, final norm) all exist in `model`."""
    if model is None:
        return None
    for name, arch in ARCHITECTURES.items():
        try:
            blk = get_path(model, arch.layers)[0]
            get_path(model, arch.final_norm)
            for p in (arch.key, arch.value, arch.up, arch.act):
                if p:
                    get_path(blk, p)
            return name
        except (AttributeError, IndexError, TypeError, KeyError):
            continue
    return None


def _skeleton(cfg):
    """The model a config describes, built on the meta device (no weights, no memory), or None."""
    try:
        import warnings

        import torch
        from transformers import AutoModelForCausalLM

        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return AutoModelForCausalLM.from_config(cfg)
    except Exception:  # noqa: BLE001 - no structure to compare: the hint is only by name
        return None


def supported() -> list[str]:
    """The model types ffkv reads, sorted."""
    return sorted(ARCHITECTURES)


def find(cfg, model=None) -> Architecture:
    """The entry for a model's config, checked; a one-line error for anything else, naming the
    closest family: the one whose module paths `model` has (given, or built from the config on
    the meta device), else, where there is no model to look at, the nearest name."""
    mt = getattr(cfg, "model_type", None) or "?"
    if mt not in ARCHITECTURES:
        model = model if model is not None else _skeleton(cfg)
        layout = _layout_match(model)
        close = difflib.get_close_matches(mt, list(ARCHITECTURES), n=1, cutoff=0.6)
        hint = (f" (its modules match the layout of {layout!r}; not checked)" if layout else
                f" (closest name: {close[0]!r})" if close and model is None else "")
        raise FfkvError(f"unsupported architecture {mt!r}{hint}; supported: "
                        f"{', '.join(sorted(ARCHITECTURES))}")
    arch = ARCHITECTURES[mt]
    arch.check(cfg)
    return arch
