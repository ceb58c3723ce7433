"""Change a fact in the FFN's values: ROME, MEMIT, and the key-value baseline no editor has.

All three write a low-rank change to the values of the layers they edit, ΔV_l = U_l R_lᵀ
(U_l (d_m, r) on the memory axis, R_l (d, r) in the residual stream; rank 1 for one fact), and an
`Edit` keeps only those factors: applied to the model's weights within a block (`applied`) or saved
into a Hugging Face folder (`export`). In ffkv's terms the FFN writes y = Σ_i m_i v_i = Vᵀ m, so a
change ΔV adds (U Rᵀ)ᵀ m = R (Uᵀ m) to y wherever the keys m point along U.

- **ROME** (Meng et al. 2022): the key k̄ is m at the subject's last token averaged over the prompt
  behind short prefixes (ROME samples them from the model; here they are the starts of the run's
  own corpus sentences, seeded, the text C was measured on); the target v* is the FFN output there
  that makes the new object likely (`target_output`: Adam on a δ added to y, ROME's loss: the new
  object's NLL, KL to the unedited "{subject} is a" next-token distribution, a norm penalty and
  clamp); u = C⁻¹k̄/‖C⁻¹k̄‖, r = (v* − y₀)/(u·k₀) (k₀, y₀: key and output at the bare prompt), so
  the edited output at k₀ is exactly v*. C = E[m mᵀ] from `ffkv mine --covariance`.
- **MEMIT** (Meng et al. 2023): the target is the residual stream after the last layer of the range
  (`target_hidden`); each layer l of the range in turn takes its share of what is still missing,
  ΔV_l = (λC + K Kᵀ)⁻¹ K Rᵀ in closed form per layer (`memit`), a batch of facts at once. λ is
  relative by default (`memit_factors`): λ = λ_rel · mean_i k_iᵀC⁻¹k_i, so that one fact's key gets
  the share 1/(1 + λ_rel) of what it asks of a layer whatever the keys' scale and C's size;
  `lam=` (`--lambda`) gives an absolute λ instead (MEMIT's published 15000 for GPT-J).
- **values**: the located memories of one layer alone (the top k at the subject's last token by a
  `locate` method): Δv_i = m_i(k₀)·(v* − y₀)/Σ_j m_j(k₀)² for i among them, the least change to
  those values that gives v* at k₀. No covariance: what it disturbs elsewhere is what their keys
  fire on (their triggers, in the browser).

Post-FFN norm families (Gemma 2/3, OLMo 2) get ΔV through the norm's gain, with the token's norm
scale as the model then computes it (exact where the scale does not move; `Edit.check` measures
the rewrite as applied). A mixture of experts is refused.
"""
from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ffkv.errors import FfkvError
from ffkv.model.prefix import context, continued, fits, prefix_cache
from ffkv.steps.facts import GPTJ_D_M, MEMIT_LAMBDA, MEMIT_LAMBDA_REL  # noqa: F401  (MEMIT's λ, one place)

METHODS = ("rome", "memit", "values")
# ROME's published hyperparameters (GPT-2 XL / GPT-J): Adam steps, rate, KL weight, norm penalty,
# clamp of ‖δ‖ at this many times ‖y₀‖, and prefixes (ROME: 10 of 5 and 10 of 10 tokens)
ROME_HP = dict(steps=20, lr=0.5, kl_factor=0.0625, weight_decay=0.5, clamp=4.0)
# MEMIT's published ones (`kmeng01/memit`, hparams/MEMIT/EleutherAI_gpt-j-6B.json): the same, but
# its z may move the residual by at most 0.75 × its norm (clamp_norm_factor), not ROME's 4
# (`memit_hp` says where that bound applies)
MEMIT_HP = {**ROME_HP, "clamp": 0.75}
PREFIXES, PREFIX_TOKENS = 10, 10


@dataclass
class Edit:
    """A low-rank change to the values of some layers: ΔV_l = U_l R_lᵀ."""
    method: str
    factors: dict  # layer -> (U (d_m, r), R (d, r)) float32 numpy
    facts: list = field(default_factory=list)  # the requests, as dicts
    settings: dict = field(default_factory=dict)
    targets: dict = field(default_factory=dict)  # layer -> the output the edit was solved for (d,)

    @property
    def layers(self) -> list[int]:
        return sorted(self.factors)

    def delta(self, layer: int) -> torch.Tensor:
        U, R = self.factors[layer]
        return torch.from_numpy(U) @ torch.from_numpy(R).T  # (d_m, d)

    def rank(self, layer: int) -> int:
        """ΔV's numerical rank, from the factors in float64 (products of float32 are exact there)."""
        U, R = self.factors[layer]
        return int(torch.linalg.matrix_rank(torch.from_numpy(U).double() @ torch.from_numpy(R).double().T))

    def save(self, path: Path) -> None:
        """Into `path` (a folder): factors.npz and edit.json, written whole or not at all. An edit
        already there is replaced only once the new one is whole beside it (two renames: the old
        aside, the new in), so a failed or killed write leaves the old edit, never half of either."""
        import os
        import shutil

        from ffkv.atomic import staged

        path = Path(path)
        if not (path.is_dir() and any(path.iterdir())):
            with staged(path) as tmp:
                self._write(tmp)
            return
        new = path.with_name(f".{path.name}.new.tmp{os.getpid()}")
        aside = path.with_name(f".{path.name}.old.tmp{os.getpid()}")
        with staged(new) as tmp:
            self._write(tmp)
        try:
            os.replace(path, aside)
            os.replace(new, path)
        except BaseException:
            if aside.exists() and not path.exists():
                os.replace(aside, path)
            shutil.rmtree(new, ignore_errors=True)
            raise
        shutil.rmtree(aside, ignore_errors=True)

    def _write(self, tmp: Path) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        arrs = {}
        for l, (U, R) in self.factors.items():
            arrs[f"U_{l}"], arrs[f"R_{l}"] = U, R
        for l, t in self.targets.items():
            arrs[f"target_{l}"] = t
        np.savez(tmp / "factors.npz", **arrs)
        (tmp / "edit.json").write_text(json.dumps(
            {"method": self.method, "layers": self.layers, "facts": self.facts, "settings": self.settings},
            indent=2))

    @classmethod
    def load(cls, path: Path) -> "Edit":
        path = Path(path)
        try:
            meta = json.loads((path / "edit.json").read_text())
            z = np.load(path / "factors.npz")
            factors = {int(l): (z[f"U_{l}"], z[f"R_{l}"]) for l in meta["layers"]}
            targets = {int(k[7:]): z[k] for k in z.files if k.startswith("target_")}
        except (OSError, ValueError, KeyError) as e:
            raise FfkvError(f"{path} is not a readable edit ({type(e).__name__}: {str(e)[:120]})") from None
        return cls(meta["method"], factors, meta.get("facts", []), meta.get("settings", {}), targets)


# ---- where an edit goes ---------------------------------------------------------------------------------------------
def _refuse_moe(mm) -> None:
    if mm.arch.moe_info(mm.blocks[0]):
        raise FfkvError("facts edit: a mixture of experts is not supported (its values live in fused expert weights)")


def check_layer(mm, layer: int) -> int:
    if not 0 <= int(layer) < mm.n_layers:
        raise FfkvError(f"--layer {layer} out of range 0..{mm.n_layers - 1}")
    return int(layer)


@contextmanager
def applied(mm, edit: Edit):
    """Within the block the model runs with the edit in its weights; after it, the weights are
    restored bit for bit (a copy of each edited value matrix is kept meanwhile)."""
    _refuse_moe(mm)
    saved = {}
    try:
        with torch.no_grad():
            for l in edit.layers:
                blk = mm.blocks[check_layer(mm, l)]
                w = mm.arch.value_param(blk)
                saved[l] = w.detach().clone()
                mm.arch.add_values(blk, edit.delta(l).to(w.device))
        yield mm
    finally:
        with torch.no_grad():
            for l, w0 in saved.items():
                mm.arch.value_param(mm.blocks[l]).copy_(w0)


def export(mm, edit: Edit, out: Path) -> Path:
    """The edited model as a Hugging Face folder (weights and tokenizer) that `transformers`
    loads with no ffkv code; written whole or not at all."""
    from ffkv.atomic import staged

    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FfkvError(f"--export {out} exists and is not empty")
    with applied(mm, edit), staged(out) as tmp:
        mm.hf.save_pretrained(tmp)
        mm.tok.save_pretrained(tmp)
    return out


# ---- the request's token positions ------------------------------------------------------------------------------------
@dataclass
class Request:
    """One fact to write: prompt template with "{}", subject, new object (and the true one)."""
    prompt: str
    subject: str
    target_new: str
    target_true: str | None = None

    @property
    def text(self) -> str:
        return self.prompt.replace("{}", self.subject, 1)

    def as_dict(self) -> dict:
        return {"prompt": self.prompt, "subject": self.subject, "target_new": self.target_new,
                "target_true": self.target_true}


def _encode(mm, texts: list[str], subject: str):
    """Right-padded ids (B, T), lengths and each text's subject's last token."""
    from ffkv.steps.facts.data import prompt_ids
    from ffkv.steps.facts.trace import subject_span

    seqs, last = [], []
    for t in texts:
        ids = prompt_ids(mm.tok, t, mm.max_length)
        seqs.append(ids)
        last.append(subject_span(mm.tok, t, subject, ids)[1] - 1)
    ids, mask = mm.batch(seqs)
    return ids, mask, torch.tensor([len(s) for s in seqs]), torch.tensor(last)


def prefixes_from(run, tok, n: int = PREFIXES, tokens: int = PREFIX_TOKENS, seed: int = 0) -> list[str]:
    """Context templates: the bare prompt ("{}"), and the first `tokens` tokens of `n` of the
    run's sentences (seeded) before it, ending in ". {}" as ROME's do."""
    from ffkv.store import query

    col = query.table(run, "sentences", columns=["token_ids"]).column("token_ids")
    rng = np.random.default_rng(seed)
    rows = rng.choice(len(col), size=min(n, len(col)), replace=False) if len(col) else []
    out = ["{}"]
    for i in sorted(int(i) for i in rows):
        text = tok.decode(col[i].as_py()[:tokens], skip_special_tokens=True).strip()
        out.append(text + ". {}")
    return out


def fill(template: str, prompt: str) -> str:
    """A context template's slot (its last "{}": a prefix may hold braces) filled with `prompt`."""
    pre, post = template.rsplit("{}", 1)
    return pre + prompt + post


def keys_at(mm, layer: int, texts: list[str], subject: str) -> torch.Tensor:
    """(len(texts), d_m) m at the subject's last token of each text."""
    ids, mask, _, last = _encode(mm, texts, subject)
    m = mm.capture(ids, mask, layers=[layer])[layer]["m"]
    return m[torch.arange(len(texts)), last].float()


def output_at(mm, layer: int, text: str, subject: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(k₀ (d_m), y₀ (d)): key and FFN output at the subject's last token of one text."""
    ids, mask, _, last = _encode(mm, [text], subject)
    cap = mm.capture(ids, mask, layers=[layer], what=("m", "y"))[layer]
    return cap["m"][0, last[0]].float(), cap["y"][0, last[0]].float()


# ---- targets ---------------------------------------------------------------------------------------------------------------
def _optimize(mm, req: Request, templates: list[str], site: int, add, hp: dict, init: torch.Tensor) -> torch.Tensor:
    """ROME's objective over δ (d,) that `add(layer_block_hooks, delta, positions)` places at
    `site`: the new object's mean NLL over every template (teacher-forced over its tokens), KL of
    "{subject} is a"'s next token at the subject to the unedited one, ‖δ‖/‖init‖² penalty, ‖δ‖
    clamped at clamp·‖init‖. Returns δ."""
    from ffkv.steps.facts.data import target_ids

    new = target_ids(mm.tok, req.target_new)
    if not new:
        raise FfkvError(f"--new {req.target_new!r} has no token")
    texts, targets = [], []
    for t in templates:
        base = fill(t, req.text)
        for i in range(len(new)):
            texts.append(base + mm.tok.decode(new[:i]))
            targets.append(new[i])
    kl_text = f"{req.subject} is a"
    ids, mask, lens, last = _encode(mm, texts + [kl_text], req.subject)
    ends = lens - 1
    tgt = torch.tensor(targets)
    n = len(texts)
    delta = torch.zeros(mm.d, requires_grad=True, device=mm.device)
    opt = torch.optim.Adam([delta], lr=hp["lr"])
    kl0 = None
    rows = torch.arange(n + 1)
    want = torch.where(rows < n, ends, last)  # each row's one position read: its end, the KL row's subject
    import inspect

    # only those positions through the unembedding (transformers' logits_to_keep, per row), where the
    # model takes it: the rest of the vocabulary product is a sixth of a step's work for SmolLM2
    keeps = "logits_to_keep" in inspect.signature(mm.hf.forward).parameters
    keep = {"logits_to_keep": want[:, None].to(mm.device)} if keeps else {}
    # Each row's tokens before its subject's last token, where δ is added, do not see δ: their keys
    # and values are computed once (`ffkv.model.prefix`) and each later step runs only the tokens
    # from there on (about a third of a templated row's). The blocks below `site` do not see δ
    # either: their output, the input of block `site`, is recorded once and fed to the blocks from
    # `site` on (`_from_block`). Each shortcut is taken once a forward that way has given the first
    # step's log-probabilities again; else every step runs every token through every block.
    below, cut = {}, {}  # block `site`'s recorded input (full rows; the rows' later tokens), the cut rows

    def forward(mode: str):
        if mode.startswith("prefix"):
            kw = continued(cut["past"], last, cut["ids"], cut["mask"], context(mm))
            if keeps:
                kw["logits_to_keep"] = cut["want"][:, None]
            run = _from_block(mm, site, cut["h"]) if mode == "prefix_upper" else _input_of(mm, site, cut)
            with run:
                logits = mm.hf(**kw).logits
            return logits[:, 0] if keeps else logits[rows, cut["want"]]
        run = _from_block(mm, site, below["h"]) if mode == "upper" else _input_of(mm, site, below)
        with run:
            logits = mm.hf(input_ids=ids.to(mm.device), attention_mask=mask.to(mm.device), use_cache=False,
                           **keep).logits
        return logits[:, 0] if keep else logits[rows, want]

    def where(mode: str):
        """(positions δ is added at, the running batch's shape) in `mode`'s rows."""
        if mode.startswith("prefix"):
            return torch.zeros_like(last), list(cut["ids"].shape)
        return last, list(ids.shape)

    def starts(mode: str, lp: torch.Tensor) -> bool:
        """Whether `mode`'s forward gives the full forward's log-probabilities `lp` at this δ."""
        try:
            if mode == "prefix":
                # (a row with no token before its subject's last would be wholly masked in the prefix pass)
                if not hp.get("cache_prefix", True) or int(last.min()) < 1:
                    return False
                cut["ids"], cut["mask"] = mm.batch([ids[r, int(last[r]):int(lens[r])].tolist() for r in rows])
                if not fits(mm, int(last.max()), cut["ids"].shape[1]):
                    return False
                cut["past"] = prefix_cache(mm, ids.to(mm.device), last)
                cut["want"] = (want - last).to(mm.device)
            elif not hp.get("cache_below", True) or "h" not in (cut if mode == "prefix_upper" else below):
                return False
            with torch.no_grad(), add(delta, *where(mode)):
                again = torch.log_softmax(forward(mode).float(), -1)
        except Exception:  # noqa: BLE001  (a family whose forward takes no cache or positions: every block runs)
            return False
        return bool(torch.allclose(again, lp, rtol=1e-4, atol=1e-3))

    mode = "full"
    for it in range(hp["steps"]):
        with torch.enable_grad(), add(delta, *where(mode)):
            lp = torch.log_softmax(forward(mode).float(), -1)
            kl_lp = lp[n:]
            if kl0 is None:
                kl0 = kl_lp.detach().clone()
            nll = -lp[torch.arange(n), tgt.to(lp.device)].mean()
            kl = hp["kl_factor"] * torch.nn.functional.kl_div(kl0, kl_lp, log_target=True, reduction="batchmean")
            loss = nll + kl + hp["weight_decay"] * delta.norm() / init.norm() ** 2
            if loss.item() < 5e-2 or it == hp["steps"] - 1:
                break
            # δ's gradient alone: no weight gradients (the weights require grad in a loaded HF model,
            # and backward() would compute and keep them all, about half the step's work)
            (delta.grad,) = torch.autograd.grad(loss, [delta])
        if it == 0:  # the cheapest forward that gives this step's numbers again
            lp0 = lp.detach()
            if starts("prefix", lp0):
                mode = "prefix_upper" if starts("prefix_upper", lp0) else "prefix"
            elif starts("upper", lp0):
                mode = "upper"
        opt.step()
        with torch.no_grad():
            cap = hp["clamp"] * init.norm()
            if delta.norm() > cap:
                delta.mul_(cap / delta.norm())
    return delta.detach()


def _blocks_list(mm):
    """(the module holding the decoder blocks' list, its attribute name)."""
    from ffkv.model.arch import get_path

    parent, _, attr = mm.arch.layers.rpartition(".")
    return (get_path(mm.hf, parent) if parent else mm.hf), attr


@contextmanager
def _input_of(mm, layer: int, into: dict):
    """Within the block, each forward records block `layer`'s input hidden states in into["h"]."""
    def pre(mod, args, kwargs):
        into["h"] = (args[0] if args else kwargs["hidden_states"]).detach()

    h = mm.blocks[layer].register_forward_pre_hook(pre, with_kwargs=True)
    try:
        yield
    finally:
        h.remove()


@contextmanager
def _from_block(mm, layer: int, hidden: torch.Tensor):
    """Within the block, the model runs only its blocks from `layer` on, that block's input replaced
    by `hidden` (the embeddings are still computed, and thrown away there)."""
    parent, attr = _blocks_list(mm)
    full = getattr(parent, attr)

    def pre(mod, args, kwargs):
        if args:
            return (hidden, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": hidden}

    h = mm.blocks[layer].register_forward_pre_hook(pre, with_kwargs=True)
    setattr(parent, attr, torch.nn.ModuleList(list(full)[layer:]))
    try:
        yield
    finally:
        setattr(parent, attr, full)
        h.remove()


def _added_at(delta: torch.Tensor, last: torch.Tensor):
    """x (B, T, d) -> x with delta added at each row's position last[row] (the subject's last token)."""
    def fn(x):
        rows = torch.arange(x.shape[0], device=x.device)
        at = last.to(x.device)
        out = x.clone()
        out[rows, at] = x[rows, at] + delta.to(x.dtype)
        return out
    return fn


def target_output(mm, layer: int, req: Request, templates: list[str], hp: dict | None = None):
    """(v*, k₀, y₀): the FFN output at the subject's last token that makes the new object likely.

    A post-FFN norm (Gemma 2/3, OLMo 2: y = g ⊙ u / rms(u)) caps what the FFN can add: a δ added
    after it can ask for a y no change of the values gives, and the edit then falls short (Gemma
    3's edits did not take). There δ is sought on the raw output u, before the norm, where any
    target is reachable; v* = y₀ + g ⊙ δ / s₀ (s₀ the prompt's scale) is the change of the values
    that adds δ to u at k₀, so the edited model's forward at the prompt is the one optimised."""
    hp = {**ROME_HP, **(hp or {})}
    k0, y0 = output_at(mm, layer, req.text, req.subject)
    blk = mm.blocks[layer]
    post = getattr(mm.arch, "post_norm", None)

    @contextmanager
    def add(delta, last, shape):
        if post is None:
            hooks = mm.arch.edit_y(blk, _added_at(delta, last), shape)
        else:
            put = _added_at(delta, last)
            hooks = [mm.arch.module(blk, mm.arch.value).register_forward_hook(lambda mod, args, out: put(out))]
        try:
            yield
        finally:
            for h in hooks:
                h.remove()

    if post is None:
        return y0 + _optimize(mm, req, templates, layer, add, hp, y0), k0, y0
    u0 = raw_output_at(mm, layer, req.text, req.subject)
    s0 = 1.0 / mm.arch.inv_scale(blk, u0[None].float())[0, 0]
    delta = _optimize(mm, req, templates, layer, add, hp, u0)
    g = mm.arch.norm_gain(mm.arch.module(blk, post))
    g = torch.ones_like(delta) if g is None else g.detach().to(delta.device, delta.dtype)
    return y0 + g * delta / s0, k0, y0


def raw_output_at(mm, layer: int, text: str, subject: str) -> torch.Tensor:
    """(d,) the FFN's raw output u (the value projection's, before a post-FFN norm) at the
    subject's last token of one text."""
    ids, mask, _, last = _encode(mm, [text], subject)
    got = {}
    h = mm.arch.module(mm.blocks[layer], mm.arch.value).register_forward_hook(
        lambda mod, args, out: got.__setitem__("u", out.detach()))
    try:
        with torch.no_grad():
            mm.hf(input_ids=ids.to(mm.device), attention_mask=mask.to(mm.device), use_cache=False)
    finally:
        h.remove()
    return got["u"].reshape(len(ids), -1, got["u"].shape[-1])[0, last[0]].float()


def _inv(C: torch.Tensor) -> torch.Tensor:
    """C⁻¹ where C is well conditioned, else its pseudo-inverse (a dead memory's row is zero)."""
    return torch.linalg.pinv(C, hermitian=True)


def _solve(C: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """C⁻¹k by Cholesky (a twentieth of an eigendecomposition's work), or through the
    pseudo-inverse where C is not positive definite (a dead memory's zero row)."""
    L, info = torch.linalg.cholesky_ex(C)
    if int(info) == 0:
        x = torch.cholesky_solve(k.reshape(-1, 1), L).reshape(-1)
        if torch.isfinite(x).all() and torch.allclose(C @ x, k, rtol=1e-6, atol=1e-9 * float(k.abs().max())):
            return x
    return _inv(C) @ k


def rome(mm, layer: int, req: Request, C: np.ndarray, templates: list[str], hp: dict | None = None,
         target=None) -> Edit:
    """ROME's rank-one edit of one fact at `layer`, preconditioned by C = E[m mᵀ] of that layer.
    `target`: (v*, k₀, y₀) from `target_output` when already computed (the values edit shares it)."""
    _refuse_moe(mm)
    layer = check_layer(mm, layer)
    C = torch.tensor(np.asarray(C), dtype=torch.float64)  # a copy: the table's array is read-only
    if C.shape != (mm.d_m, mm.d_m):
        raise FfkvError(f"the covariance of layer {layer} is {tuple(C.shape)}, not ({mm.d_m}, {mm.d_m})")
    kbar = keys_at(mm, layer, [fill(t, req.text) for t in templates], req.subject).mean(0)
    vstar, k0, y0 = target if target is not None else target_output(mm, layer, req, templates, hp)
    u, r = rome_factors(C, kbar, k0, vstar, y0)
    return Edit("rome", {layer: (u[:, None], r[:, None])}, [req.as_dict()],
                {**ROME_HP, **(hp or {}), "templates": templates}, {layer: vstar.float().numpy()})


def rome_factors(C, kbar, k0, vstar, y0) -> tuple[np.ndarray, np.ndarray]:
    """ROME's closed form: u = C⁻¹k̄/‖C⁻¹k̄‖, r = (v* − y₀)/(u·k₀), ΔV = u rᵀ."""
    left = _solve(torch.tensor(np.asarray(C), dtype=torch.float64), torch.as_tensor(kbar, dtype=torch.float64))
    u = left / left.norm()
    r = (torch.as_tensor(vstar, dtype=torch.float64) - torch.as_tensor(y0, dtype=torch.float64)) / \
        (u @ torch.as_tensor(k0, dtype=torch.float64))
    return u.float().numpy(), r.float().numpy()


def values_edit(mm, layer: int, req: Request, templates: list[str], top: int = 10, method: str = "grad",
                hp: dict | None = None, target=None) -> Edit:
    """Rewrite only the values of the `top` memories of `layer` that `locate` ranks first at the
    subject's last token (by `method`), so that the FFN gives v* at k₀."""
    from ffkv.steps.facts.data import prompt_ids, target_ids
    from ffkv.steps.facts.locate import rank

    _refuse_moe(mm)
    layer = check_layer(mm, layer)
    text = req.text
    vstar, k0, y0 = target if target is not None else target_output(mm, layer, req, templates, hp)
    from ffkv.steps.facts.trace import subject_span

    ids = prompt_ids(mm.tok, text, mm.max_length)
    pos = subject_span(mm.tok, text, req.subject, ids)[1] - 1
    true = target_ids(mm.tok, req.target_true or req.target_new)[0]
    scores = rank(mm, ids, true, pos, method, layers=[layer]).scores[layer]
    dims = np.argsort(-scores, kind="stable")[:top]
    u = torch.zeros(mm.d_m, dtype=torch.float64)
    k = k0.double()
    u[dims] = k[dims] / k[dims].pow(2).sum().clamp_min(1e-30)
    r = (vstar - y0).double()
    return Edit("values", {layer: (u.float().numpy()[:, None], r.float().numpy()[:, None])}, [req.as_dict()],
                {**ROME_HP, **(hp or {}), "top": int(top), "locate": method, "dims": dims.tolist(),
                 "templates": templates}, {layer: vstar.float().numpy()})


# ---- MEMIT ---------------------------------------------------------------------------------------------------------------
@contextmanager
def _residual_edit(mm, layer: int, fn):
    """fn(h) (B, T, d) -> h' on the residual stream after block `layer`."""
    def hook(mod, args, out):
        h = out[0] if isinstance(out, tuple) else out
        new = fn(h)
        return (new, *out[1:]) if isinstance(out, tuple) else new
    handle = mm.blocks[layer].register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def hidden_at(mm, layer: int, text: str, subject: str) -> torch.Tensor:
    """The residual stream after block `layer` at the subject's last token of `text`."""
    ids, mask, _, last = _encode(mm, [text], subject)
    return mm.capture(ids, mask, layers=[layer], what=("o",))[layer]["o"][0, last[0]].float()


def target_hidden(mm, layer: int, req: Request, templates: list[str], hp: dict | None = None) -> torch.Tensor:
    """MEMIT's z: the residual stream after block `layer` at the subject's last token that makes
    the new object likely (ROME's objective, δ added to the residual instead of the FFN output)."""
    hp = {**ROME_HP, **(hp or {})}
    h0 = hidden_at(mm, layer, req.text, req.subject)

    @contextmanager
    def add(delta, last, shape):
        with _residual_edit(mm, layer, _added_at(delta, last)):
            yield

    return h0 + _optimize(mm, req, templates, layer, add, hp, h0)


def memit_target(mm, layer: int, req: Request, templates: list[str], hp: dict | None = None) -> torch.Tensor:
    """MEMIT's z at block `layer`. A post-FFN norm family's residual target is sought as ROME's is,
    on the raw output u (`target_output`), and z = h₀ + (v* − y₀): a δ added after the norm asked
    the values for a residual change that no change of them gives (Gemma 3's MEMIT edits took on no
    fact), while v* − y₀ is the change that writes δ into u at the prompt. Its settings:
    `memit_hp`."""
    hp = memit_hp(mm, hp)
    if getattr(mm.arch, "post_norm", None) is None:
        return target_hidden(mm, layer, req, templates, hp)
    vstar, _, y0 = target_output(mm, layer, req, templates, hp)
    return hidden_at(mm, layer, req.text, req.subject) + (vstar - y0).float()


def memit_hp(mm, hp: dict | None = None) -> dict:
    """MEMIT's settings on mm: `MEMIT_HP`, and what `hp` overrides. MEMIT's clamp bounds how far z
    moves the residual (0.75 × ‖h₀‖). Behind a post-FFN norm z is sought on the raw output u, and
    the residual then moves by ‖norm(u₀ + δ) − y₀‖ ≤ about 2‖y₀‖, which the norm holds below that
    bound (Gemma 3 270M at layer 5: 2‖y₀‖ ≈ 0.3‖h₀‖); a clamp of 0.75 × ‖u₀‖ on δ there asked far
    less than MEMIT does (0 of 5 facts took), so δ keeps ROME's bound, 4 × ‖u₀‖."""
    base = MEMIT_HP if getattr(mm.arch, "post_norm", None) is None else ROME_HP
    return {**base, **(hp or {})}


def memit_factors(C, K, lam: float | None = None, lam_rel: float = MEMIT_LAMBDA_REL):
    """(U (d_m, n), λ): MEMIT's left factor U = (λC + K Kᵀ)⁻¹ K of one layer, K the facts' keys
    (d_m, n), C = E[m mᵀ]. λ is `lam` when given (absolute, as MEMIT's mom2_update_weight), else
    λ_rel · q̄ with q̄ = mean_i k_iᵀC⁻¹k_i, the edited keys' mean squared norm whitened by C. By
    Sherman-Morrison a lone fact's update gives Uᵀk = q/(λ + q) of its share at its key, i.e.
    1/(1 + λ_rel): λ_rel is what C weighs against an edited key, in units of that key, and neither
    the keys' scale (C → s²C, K → sK leaves q̄ and UᵀK as they are) nor d_m changes its meaning."""
    C = torch.tensor(np.asarray(C), dtype=torch.float64)  # a copy: the table's array is read-only
    K = torch.as_tensor(K, dtype=torch.float64)
    if lam is None:
        q = torch.stack([K[:, i] @ _solve(C, K[:, i]) for i in range(K.shape[1])])
        lam = float(lam_rel) * float(q.mean())
    U = torch.linalg.solve(float(lam) * C + K @ K.T, K)
    return U, float(lam)


def memit(mm, layers, reqs: list[Request], covs: dict, templates: list[str], hp: dict | None = None,
          lam: float | None = None, lam_rel: float = MEMIT_LAMBDA_REL) -> Edit:
    """MEMIT's batch edit over `layers` (a range, e.g. 4-8): the targets z at the last of them, then
    layer by layer ΔV_l = (λC_l + K Kᵀ)⁻¹ K Rᵀ, K the facts' keys (d_m, n) averaged over the
    templates, R = (z − h_L)/(layers left) what the residual still lacks, h_L read with the
    layers before already edited. C_l = E[m mᵀ] of each layer (`covs`). λ: `lam` absolute when
    given (MEMIT's published MEMIT_LAMBDA = 15000), else relative, λ_rel · mean k_iᵀC_l⁻¹k_i per
    layer (`memit_factors`); each layer's λ is recorded in the settings."""
    _refuse_moe(mm)
    layers = sorted({check_layer(mm, l) for l in layers})
    if not reqs:
        raise FfkvError("facts edit --method memit: no fact to edit")
    missing = [l for l in layers if l not in covs]
    if missing:
        raise FfkvError(f"facts edit --method memit: no key covariance of layer {missing[0]}")
    if lam is not None and not float(lam) > 0:
        raise FfkvError(f"MEMIT's --lambda {lam}: give a positive number")
    top = layers[-1]
    Z = torch.stack([memit_target(mm, top, r, templates, hp) for r in reqs]).double()  # (n, d)
    rule = ({"lambda": float(lam), "lambda_rule": "absolute"} if lam is not None else
            {"lambda_rel": float(lam_rel), "lambda_rule": "relative: lambda = lambda_rel * mean_i k_i' C^-1 k_i"})
    edit = Edit("memit", {}, [r.as_dict() for r in reqs],
                {**memit_hp(mm, hp), **rule, "lambda_by_layer": {}, "layers": layers, "templates": templates},
                {top: Z.float().numpy()})
    for i, l in enumerate(layers):
        with applied(mm, edit):
            K = torch.stack([keys_at(mm, l, [fill(t, r.text) for t in templates], r.subject).mean(0)
                             for r in reqs]).double().T  # (d_m, n)
            H = torch.stack([hidden_at(mm, top, r.text, r.subject) for r in reqs]).double()  # (n, d)
        R = (Z - H) / (len(layers) - i)  # (n, d)
        U, lam_l = memit_factors(covs[l], K, lam, lam_rel)
        edit.settings["lambda_by_layer"][str(l)] = lam_l
        edit.factors[l] = (U.float().numpy(), R.T.float().numpy())
    return edit
