"""Sign regimes of a gated FFN's memories, from the mining pass (`ffkv mine --regimes`).

A gated memory's coefficient is m_i = f(x·g_i)·(x·u_i). Each token falls in one of four regimes
by the sign of its gate pre-activation x·g_i and of its input x·u_i, in this order throughout
(gate, input):

    pp (+, +)    pn (+, −)    np (−, +)    nn (−, −)

and this tracker sums, per mined memory, the activation mass Σ|m_i| and the tokens with m_i ≠ 0
in each (GLUScope's four combinations, Gerstner & Schütze 2025; issue 46's census).

Only the gate's sign is captured beside m (`ffkv.model.arch.Architecture.hook_g`: the gate
projection's output, the first half of a fused gate_up): the input's sign follows, since
sign(x·u) = sign(m)·sign(f(x·g)) wherever m ≠ 0, and f(z) has z's sign or is 0 (SiLU, GELU, ReLU:
`refusal` checks the model's own activation on a grid and refuses one that does not). A token
with m_i = 0 adds nothing (its input's sign is not read); so does padding. A mixture of experts
(`ffkv.model.arch.MoE.hook_g`) hands in each expert's gate on the tokens routed to it and 0 on the
others, where m is 0 too; m = w·f(x·g)·(x·u) with a positive weight w (the router's, or the shared
expert's sigmoid gate), so the same rule reads the input's sign (the experts' activation is the one
checked; Qwen2-MoE's shared expert has the same, the config's hidden_act).

Per batch and layer the sums run in float64 (numba on a CPU, one read of m and g; torch
elsewhere) for up to `FLUSH` batches and are then carried in exact integer limbs
(`ffkv.mine.rules.to_limbs`), as `ffkv.mine.covariance` does: merging states (Ray shards) adds
integers, associative and order-free bit for bit; the counts are integers. A resumed pass
differs from an unbroken one by float rounding only. State: 4·(24 + 8 + 8)·n bytes a layer.

Passes with --regimes run the eager forward (FFKV_COMPILE / --compile is held at 0: the compiled
blocks tap m only); packed rows and the fused kernels of the other trackers work as ever.

Table ``sign_regimes`` (a public contract), one row per mined memory, sorted by layer and dim:
layer int16, dim int32, tokens int64 (valid tokens seen), tokens_pp, tokens_pn, tokens_np,
tokens_nn int64 (tokens with m ≠ 0 in each regime), mass_pp, mass_pn, mass_np, mass_nn float64
(Σ|m| in each regime), share_pp, share_pn, share_np, share_nn float64 (mass / total mass: they
sum to 1; null where the total mass is 0). Read it with `ffkv.store.query.sign_regimes(run)`.
"""
from __future__ import annotations

import numpy as np
import torch

from ffkv.mine.groups import layer_groups
from ffkv.mine.rules import from_limbs, to_limbs

TABLE = "sign_regimes"
REGIMES = {"pp": "(+,+)", "pn": "(+,-)", "np": "(-,+)", "nn": "(-,-)"}  # name: (gate sign, input sign), in order


def regime_of(g, u) -> np.ndarray:
    """Index into `REGIMES` of each token by the signs of its gate pre-activation g and its input u
    (each + when > 0): the rule the kernels below apply (they read u's sign from m's and g's)."""
    return 2 * (np.asarray(g) <= 0).astype(np.int64) + (np.asarray(u) <= 0).astype(np.int64)


FLUSH = 32  # batches summed in float64 before they join the exact limbs
KEYS = 256  # keys per numba thread's block


def keeps_sign(act, dtypes=(torch.float32,)) -> bool:
    """Whether f(z) has z's sign or is 0, on a grid of z (tiny to huge, both signs)."""
    mags = torch.cat([torch.logspace(-30, 4, 300, dtype=torch.float64), torch.linspace(0.01, 20, 400,
                                                                                        dtype=torch.float64)])
    z = torch.cat([mags, -mags, torch.zeros(1, dtype=torch.float64)])
    for dt in dtypes:
        with torch.no_grad():
            f = act(z.to(dt)).double()
        zz = z.to(dt).double()
        if not bool(((f == 0) | (torch.sign(f) == torch.sign(zz))).all()):
            return False
    return True


def refusal(mm, layers=None) -> str | None:
    """Why `mm`'s memories have no sign regimes here (one line), or None."""
    why = mm.arch.gate_refusal()
    if why:
        return f"{mm.arch.name} {why}"
    dev_dt = getattr(mm, "dtype", torch.float32)
    dts = (torch.float32,) if dev_dt == torch.float32 else (torch.float32, dev_dt)
    shared = getattr(mm.arch, "shared", None)  # a mixture of experts' shared expert has its own
    for l in sorted(set(range(mm.n_layers) if layers is None else layers)):
        acts = [(mm.act(l), mm.act_name)]
        if shared:
            sh = mm.arch.module(mm.blocks[l], shared).act_fn
            acts.append((sh, f"{type(sh).__name__} (its shared expert's)"))
        for act, name in acts:
            try:
                ok = keeps_sign(act, dts)
            except Exception:  # noqa: BLE001  (an activation that takes no plain tensor)
                ok = False
            if not ok:
                return (f"{mm.arch.name}'s activation {name} (layer {l}) does not keep its input's sign, "
                        "so the input's sign cannot be read from m")
    return None


_kernel = None


def _compile():
    global _kernel
    if _kernel is None:
        from numba import njit, prange

        @njit(parallel=True, cache=True, nogil=True, fastmath=False)
        def regimes(m, off, g, valid, mass, count):  # pragma: no cover
            B, T, W = g.shape
            for blk in prange((W + KEYS - 1) // KEYS):
                k0 = blk * KEYS
                w = min(W, k0 + KEYS) - k0
                # one flat accumulator per sum and rows read as slices: the key loop vectorises
                # (a (4, KEYS) block of sums and m[b, t, off + k0 + j] reads ran 1.65x slower)
                a0 = np.zeros(KEYS, np.float64)
                a1 = np.zeros(KEYS, np.float64)
                a2 = np.zeros(KEYS, np.float64)
                a3 = np.zeros(KEYS, np.float64)
                cp = np.zeros(KEYS, np.int32)
                cn = np.zeros(KEYS, np.int32)
                gcp = np.zeros(KEYS, np.int32)
                gcn = np.zeros(KEYS, np.int32)
                for b in range(B):
                    for t in range(T):
                        if not valid[b, t]:
                            continue
                        mr = m[b, t, off + k0:off + k0 + w]
                        gr = g[b, t, k0:k0 + w]
                        # branch-free: gate + and m > 0 is input + (pp), m < 0 input − (pn); gate −
                        # and m < 0 is input + (np), m > 0 input − (nn); each sum exact per token
                        for j in range(w):
                            v = np.float64(mr[j])
                            gp = gr[j] > 0
                            pos = v if v > 0.0 else 0.0
                            neg = -v if v < 0.0 else 0.0
                            gpos = pos if gp else 0.0
                            gneg = neg if gp else 0.0
                            a0[j] += gpos
                            a1[j] += gneg
                            a2[j] += neg - gneg
                            a3[j] += pos - gpos
                            ip, ineg, ig = np.int32(v > 0.0), np.int32(v < 0.0), np.int32(gp)
                            cp[j] += ip
                            cn[j] += ineg
                            gcp[j] += ip & ig
                            gcn[j] += ineg & ig
                for j in range(w):
                    mass[0, k0 + j] += a0[j]
                    mass[1, k0 + j] += a1[j]
                    mass[2, k0 + j] += a2[j]
                    mass[3, k0 + j] += a3[j]
                    count[0, k0 + j] += gcp[j]
                    count[1, k0 + j] += gcn[j]
                    count[2, k0 + j] += cn[j] - gcn[j]
                    count[3, k0 + j] += cp[j] - gcp[j]

        _kernel = regimes
    return _kernel


def _numba_here(device) -> bool:
    from ffkv.mine import stats_cpu

    return stats_cpu.available(device)


class SignRegimes:
    name = "regimes"
    needs = ("g",)  # what the capture hands in beside m (`ffkv.mine.trackers.LayerCapture.aux`)

    def __init__(self, layers: list[int], dims: list[int] | None, d_m: int, device=None, group: int = 1):
        self.layers = list(layers)
        self.dims = None if dims is None else [int(d) for d in dims]
        self.n = len(self.dims) if self.dims is not None else int(d_m)
        self.group = int(group)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.groups = layer_groups(self.layers, group)
        self.tokens = 0
        self.mass = {l: torch.zeros((3, 4, self.n), dtype=torch.long, device=self.device) for l in self.layers}
        self.count = {l: torch.zeros((4, self.n), dtype=torch.long, device=self.device) for l in self.layers}
        self._acc = {l: torch.zeros((4, self.n), dtype=torch.float64, device=self.device) for l in self.layers}
        self._pending = 0

    def flush(self) -> None:
        """The float64 sums into the exact limbs."""
        if self._pending:
            for l in self.layers:
                self.mass[l] += to_limbs(self._acc[l])
                self._acc[l].zero_()
            self._pending = 0

    @torch.no_grad()
    def update(self, batch, cap) -> None:
        """A group's capture (`LayerCapture`, side by side): each layer as `update_layer` reads it."""
        gs = cap.aux.get("g")
        if gs is None:
            raise RuntimeError("the sign regimes need the gate pre-activations in the capture (what=g)")
        n = self.n
        for i, l in enumerate(cap.layers):
            self.update_layer(l, cap.m[..., i * n:(i + 1) * n], {"g": gs[i]}, batch)

    @torch.no_grad()
    def update_layer(self, layer: int, m: torch.Tensor, aux: dict, batch) -> None:
        """One layer's m and g (B, T, n) as the forward makes them (`MineState`): read at once, so
        that no gate capture outlives its layer (`MineState`); `update` reads a group through it."""
        g = aux.get("g")
        if g is None:
            raise RuntimeError("the sign regimes need the gate pre-activations in the capture (what=g)")
        if layer == self.layers[0]:
            self.tokens += batch.tokens
        m = m if m.dtype == torch.float32 else m.float()
        g = g if g.dtype == torch.float32 else g.float()
        if _numba_here(m.device):
            from ffkv.mine.stats_cpu import _threads

            _threads()
            _compile()(m.detach().contiguous().numpy(), 0, g.detach().contiguous().numpy(),
                       batch.mask.detach().contiguous().numpy(), self._acc[layer].numpy(), self.count[layer].numpy())
        else:
            self._sum_torch(batch, layer, m, g)
        if layer == self.layers[-1]:  # a batch is counted once, at its last layer
            self._pending += 1
            if self._pending >= FLUSH:
                self.flush()

    def _sum_torch(self, batch, l: int, M: torch.Tensor, G: torch.Tensor) -> None:
        """Layer l's masses and counts from its m and g (B, T, n), in torch."""
        n = self.n
        if batch.runs is not None:
            parts = [(M[a:e, :L], G[a:e, :L]) for a, e, L in batch.runs]
        else:  # padding to 0: it adds nothing
            parts = [(M.masked_fill(~batch.mask.unsqueeze(-1), 0.0), G)]
        for Mb, Gb in parts:
            Mb, Gb = Mb.reshape(-1, n), Gb.reshape(-1, n)
            Mg = torch.where(Gb > 0, Mb, 0.0)  # m where the gate is positive
            Mo = Mb - Mg  # and where it is not (exact: m − m or m − 0)
            # gate +: m > 0 is input + (pp), m < 0 input − (pn); gate −: m < 0 is input + (np)
            for r, X, sign in ((0, Mg, 1), (1, Mg, -1), (2, Mo, -1), (3, Mo, 1)):
                part = (X * sign).clamp(min=0)
                self._acc[l][r] += part.sum(0, dtype=torch.float64)
                self.count[l][r] += (part > 0).sum(0)

    def _check(self, other: "SignRegimes") -> None:
        if (other.layers, other.dims, other.n) != (self.layers, self.dims, self.n):
            raise ValueError("cannot merge sign-regime states of different layers or dims")

    def merge(self, other: "SignRegimes") -> "SignRegimes":
        self._check(other)
        self.flush()
        other.flush()
        self.tokens += other.tokens
        for l in self.layers:
            self.mass[l] += other.mass[l].to(self.device)
            self.count[l] += other.count[l].to(self.device)
        return self

    def arrays(self) -> dict[str, np.ndarray]:
        self.flush()
        out = {"tokens": np.array([self.tokens], np.int64)}
        for l in self.layers:
            out[f"mass_{l}"] = self.mass[l].cpu().numpy()
            out[f"count_{l}"] = self.count[l].cpu().numpy()
        return out

    def load_arrays(self, arrs) -> "SignRegimes":
        new = {}
        for l in self.layers:
            for name, shape in (("mass", (3, 4, self.n)), ("count", (4, self.n))):
                a = np.asarray(arrs[f"{name}_{l}"])
                if a.shape != shape or a.dtype != np.int64:
                    raise KeyError(f"sign-regime array {name}_{l} has shape {a.shape}, not {shape}")
                new[(name, l)] = torch.from_numpy(a.copy()).to(self.device)
        self.tokens = int(np.asarray(arrs["tokens"])[0])
        for (name, l), t in new.items():
            getattr(self, name)[l] = t
        for l in self.layers:
            self._acc[l].zero_()
        self._pending = 0
        return self

    def masses(self, l: int) -> tuple[np.ndarray, np.ndarray]:
        """Layer l's (mass (4, n) float64, tokens (4, n) int64) per regime, in `REGIMES` order."""
        self.flush()
        return from_limbs(self.mass[l].cpu().numpy()), self.count[l].cpu().numpy()

    def finish(self, ctx=None) -> dict:
        import pyarrow as pa

        dims = np.asarray(self.dims if self.dims is not None else np.arange(self.n), np.int32)
        parts = []
        for l in self.layers:
            mass, cnt = self.masses(l)
            total = mass.sum(0)
            none = total <= 0
            cols = {"layer": pa.array(np.full(self.n, l, np.int16)), "dim": pa.array(dims),
                    "tokens": pa.array(np.full(self.n, self.tokens, np.int64))}
            for r, name in enumerate(REGIMES):
                cols[f"tokens_{name}"] = pa.array(cnt[r])
            for r, name in enumerate(REGIMES):
                cols[f"mass_{name}"] = pa.array(mass[r])
            with np.errstate(invalid="ignore", divide="ignore"):
                for r, name in enumerate(REGIMES):
                    cols[f"share_{name}"] = pa.array(mass[r] / np.where(none, 1.0, total), mask=none)
            parts.append(pa.table(cols))
        return {TABLE: pa.concat_tables(parts)}
