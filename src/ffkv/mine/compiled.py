"""Mining's forward with its decoder blocks compiled (off unless FFKV_COMPILE=1).

Most of a small model's forward on a GPU is element-wise work (norms, RoPE, SiLU·up, adds) in
many small kernels; torch.compile fuses them. A capture hook inside a compiled block would break
its graph, and the parts after a break were compiled again for every new batch shape (8-9 s a
batch on this CPU). So while compiled, each block's value projection is wrapped by a `_Tap` that
appends its input (the coefficients m) to a list, which dynamo keeps in the graph as a side
effect, and a hook on the block itself, outside the compiled forward, hands it to the trackers.
One graph then serves every layer and batch shape (dynamic shapes).

Families whose coefficients are read elsewhere than the value projection's input (post-FFN
norms, mixtures of experts) keep the eager forward, and so does any model whose compiled
captures differ from the eager ones on a check run when mining starts (`refusal`).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from ffkv.errors import notice
from ffkv.mine import switches

ENV = "FFKV_COMPILE"
_SINK: list = []  # the taps' inputs, one per block call, drained by the block's hook


# A pass with FFKV_COMPILE unset on CUDA starts its compiled trial after this many seconds of
# mining: a compile costs about 12 s (SmolLM2's shape, H100) and pays back only over long passes,
# so a short one never pays it, and a long one pays at most twice what it would with foresight
# (rent-or-buy: rent for as long as buying costs, then buy).
PAYS_AFTER_S = 20.0


def setting(device=None) -> str:
    """FFKV_COMPILE as "0", "1" or "auto" (the tuner times the compiled twin of the arm it chose:
    `ffkv.mine.tune`); unset: "auto" on CUDA (the trial after PAYS_AFTER_S), "0" elsewhere."""
    return switches.by_device(ENV, device, parse, "0")[0]


def trial_after(device=None) -> float | None:
    """Seconds of mining before the tuner's compiled trial: None for none, 0 under FFKV_COMPILE=auto
    (at once), PAYS_AFTER_S where auto is CUDA's default."""
    value, given = switches.by_device(ENV, device, parse, "0")
    if value != "auto":
        return None
    return 0.0 if given else PAYS_AFTER_S


def enabled() -> bool:
    """Every batch of a pass through compiled blocks (FFKV_COMPILE=1)."""
    return setting() == "1"


def parse(raw: str, name: str = ENV) -> str:
    """A compile setting (FFKV_COMPILE's, or `ffkv mine --compile`'s, named `name`)."""
    return switches.on_off_auto(raw, name, "1 compiles mining's forward, 0 (or unset) does not, auto times it "
                                "against the eager forward once the other paths are chosen")


class _Tap(torch.nn.Module):
    """A value projection that keeps its input for the block's hook (a list append: no graph break)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x, *args, **kwargs):
        _SINK.append(x)
        return self.inner(x, *args, **kwargs)


def _eligible(mm) -> str | None:
    from ffkv.model.arch import Architecture

    arch = type(mm.arch)
    if arch.hook_m is not Architecture.hook_m or arch.module is not Architecture.module:
        return f"{mm.arch.name} reads its coefficients elsewhere than the value projection's input"
    return None


class CompiledBlocks:
    """The model's blocks compiled with taps, for one mining pass; `close` puts everything back."""

    def __init__(self, mm, layers):
        from ffkv.model.arch import get_path

        self.mm, self.want = mm, set(layers)
        self.last = max(layers)
        self.callback, self.shape = None, None
        self.undo, self.hooks = [], []
        self.failed: str | None = None  # why the compiled forward failed mid-pass (`broke`)
        self._in_callback = False
        # one tap and one compiled forward a block for the model's life: a new torch.compile
        # wrapper would compile again (~10 s on a CPU) at every pass or chunk
        made = mm.__dict__.setdefault("_ffkv_compiled", {})
        parent_path, _, name = mm.arch.value.rpartition(".")
        try:
            for l, blk in enumerate(mm.blocks[: self.last + 1]):
                parent = get_path(blk, parent_path) if parent_path else blk
                inner = getattr(parent, name)
                if l not in made:
                    made[l] = (_Tap(inner), torch.compile(blk.forward, dynamic=True))
                tap, fwd = made[l]
                tap.inner = inner
                setattr(parent, name, tap)
                self.undo.append((parent, name, inner, blk))
                blk.forward = fwd
                self.hooks.append(blk.register_forward_hook(self._drain(l)))
        except Exception:
            self.close()
            raise

    def _drain(self, l: int):
        def drain(mod, args, out):
            m = _SINK.pop()
            if l in self.want and self.callback is not None:
                self._in_callback = True  # an error from here on is the trackers', not the compiler's
                self.callback(l, self.mm.arch._tokens(m.detach(), self.shape))
                self._in_callback = False
            if l == self.last:
                from ffkv.model.memories import _Stop

                raise _Stop
        return drain

    @torch.no_grad()
    def capture(self, ids: torch.Tensor, callback, **forward) -> None:
        """One forward to the last wanted layer: callback(layer, m (B, T, d_m)) at each wanted one."""
        from ffkv.model.memories import _Stop

        _SINK.clear()
        self.callback, self.shape = callback, list(ids.shape[:2])
        self._in_callback = False
        try:
            self.mm.hf(input_ids=ids, attention_mask=None, use_cache=False, **forward)
        except _Stop:
            pass
        finally:
            self.callback = None
            _SINK.clear()

    def broke(self, e: BaseException) -> bool:
        """Whether `e`, raised by `capture`, is the compiled forward's own failure (a recompile for a
        new kind of batch that Inductor cannot build, say), not a tracker's or the device's memory.
        If so the blocks are out for the rest of the pass and for this model, said once, and the
        caller runs the batch eagerly for the layers not yet handed over."""
        if self._in_callback or not isinstance(e, Exception) or isinstance(e, torch.OutOfMemoryError):
            return False
        self.failed = f"torch.compile failed mid-pass ({_why(e)})"
        self.close()
        _verdicts(self.mm)[tuple(sorted(self.want))] = self.failed
        notice(f"{ENV}: the eager forward from here on: {self.failed}")
        return True

    def close(self) -> None:
        for h in self.hooks:
            h.remove()
        for parent, name, inner, blk in self.undo:
            setattr(parent, name, inner)
            blk.__dict__.pop("forward", None)
        self.hooks, self.undo = [], []


def compiled_for(mm, layers, force: bool = False) -> CompiledBlocks | None:
    """The compiled blocks for a mining pass over `layers`, or None: FFKV_COMPILE not 1 (unless
    `force`: the tuner's compiled arm), or the model cannot (said once). The check's sentences
    (`ffkv.mine.selfcheck`) run eagerly and compiled must agree at every wanted layer, or the eager
    forward is kept."""
    from ffkv.mine import packing
    from ffkv.mine.selfcheck import first_difference, sentences
    from ffkv.model.memories import pad_rows

    if not (force or enabled()):
        return None
    if packing.setting(getattr(mm, "device", None)) is not None:
        packing.accepts(mm)  # the packing check runs the model eagerly: before the blocks change
    layers = sorted(set(layers))
    verdicts = _verdicts(mm)
    verdict = verdicts.get(tuple(layers), False)
    if verdict is None:
        return CompiledBlocks(mm, layers)
    if verdict:  # refused before, and said
        return None
    why, blocks = _eligible(mm), None
    if why is None:
        flat, lens = sentences(mm)
        ids, mask = pad_rows(flat, lens, mm.pad_id(), getattr(mm, "device", "cpu"))
        eager = mm.capture(ids, None, layers=layers, what=("m",))  # before the blocks change
        got = {}
        try:
            blocks = CompiledBlocks(mm, layers)
            blocks.capture(ids, lambda l, m: got.__setitem__(l, m))
        except Exception as e:  # noqa: BLE001  (a compiler that cannot: say why, mine eagerly)
            why = f"torch.compile failed ({_why(e)})"
        else:
            diff = first_difference(mm, got, {l: eager[l]["m"] for l in layers}, mask.bool())
            why = diff and f"its compiled coefficients differ from the eager ones (layer {diff[0]}: {diff[1]:.1e})"
        if why and blocks is not None:
            blocks.close()
            blocks = None
    verdicts[tuple(layers)] = why
    if why:
        notice(f"{ENV}: the eager forward for this model: {why}")
    return blocks


def _verdicts(mm) -> dict:
    """Layers (sorted tuple) -> None (compiled blocks check out) or why not: once a model."""
    return mm.__dict__.setdefault("_ffkv_compile_verdicts", {})


def _why(e: BaseException) -> str:
    first = str(e).splitlines()[0][:160] if str(e) else ""
    return f"{type(e).__name__}: {first}"


def accepted(mm, layers) -> bool:
    """Whether mining over `layers` ran (or would run) through compiled blocks."""
    key = tuple(sorted(set(layers)))
    return enabled() and _verdicts(mm).get(key, False) is None


@contextmanager
def mining_forward(mm, layers):
    """A pass's compiled blocks under FFKV_COMPILE=1 (None otherwise), put back at the end. Eager
    batches run their products through oneDNN on a CPU (`ffkv.mine.engine`, batch by batch: dynamo
    cannot trace that mode, and the tuner's compiled arm needs it off for its own batches)."""
    blocks = compiled_for(mm, layers)
    try:
        yield blocks
    finally:
        if blocks is not None:
            blocks.close()
