"""Float32 products with a model's weights through oneDNN instead of MKL, on a CPU.

Why: on this project's AMD (Zen) CPUs, torch's MKL sgemm runs a generic path at about half the
speed of oneDNN's kernels on the same float32 shapes (measured: SmolLM2's forward 1.8× faster on
one session's VM, 1.4× on another: the gain depends on the CPU),
and the forward passes and vocabulary projections are 80% of the steps after mining. Results
change by float rounding only (a test holds them to MKL's within float32 tolerance, and a row's
result to its result in another batch).

`fast_products()` is a scoped mode: inside it `F.linear(x, W, b)` and `x @ W.T` with W a model
parameter (a Linear's weight, the unembedding) run oneDNN's linear on a cached copy of W packed
for it, with dense input and output (`mkldnn._linear_pointwise`, as torch.compile's CPU code
uses; converting x and y to and from oneDNN tensors cost a third of a vocabulary projection);
anything else (other dtypes, autograd, CUDA, a W that is no parameter) runs as before. Set
FFKV_ONEDNN=0 to turn it off.
"""
from __future__ import annotations

import os
from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_MATMULS = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__)


# Rows the packed weights are laid out for (oneDNN's batch-size hint). One fixed value: a row's
# result then depends on neither the batch nor the call history; measured no slower at 3 to 2,048.
PACK_ROWS = 256


def enabled() -> bool:
    return (os.environ.get("FFKV_ONEDNN", "1") != "0" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class _OneDNN(TorchFunctionMode):
    """Routes products with parameters to oneDNN; keeps each parameter's oneDNN copy while the mode
    lives (checked against the parameter's identity and version, so an edited weight is re-copied)."""

    def __init__(self, copies: dict | None = None):
        super().__init__()
        self.copies: dict[int, tuple] = {} if copies is None else copies

    def _weight(self, W: torch.Tensor):
        e = self.copies.get(id(W))
        if e is None or e[0] is not W or e[1] != W._version:
            packed = torch.ops.mkldnn._reorder_linear_weight(W.detach().contiguous(), PACK_ROWS)
            e = self.copies[id(W)] = (W, W._version, packed)
        return e[2]

    @staticmethod
    def _fits(x, W, b=None) -> bool:
        ok = (isinstance(W, torch.nn.Parameter) and isinstance(x, torch.Tensor) and x.dim() >= 2
              and x.dtype == W.dtype == torch.float32 and x.device.type == W.device.type == "cpu"
              and x.layout == torch.strided and x.numel() > 0 and x.shape[-1] == W.shape[1]
              and not (torch.is_grad_enabled() and (x.requires_grad or W.requires_grad)))
        return ok and (b is None or (isinstance(b, torch.Tensor) and b.dtype == torch.float32
                                     and b.device.type == "cpu" and b.dim() == 1
                                     and not (torch.is_grad_enabled() and b.requires_grad)))

    def _linear(self, x, W, b):
        shape = x.shape
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]).contiguous(), self._weight(W),
                                               None if b is None else b.detach().contiguous(), "none", [], "")
        return y.view(*shape[:-1], W.shape[0])

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, W = args[0], args[1]
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            if self._fits(x, W, b):
                return self._linear(x, W, b)
        elif func in _MATMULS and len(args) == 2:
            x, other = args
            W = getattr(other, "_base", None)  # other = W.T, a transposed view of a parameter
            if (W is not None and other.dim() == 2 and W.dim() == 2 and other.shape == W.shape[::-1]
                    and other.stride() == W.stride()[::-1] and other.data_ptr() == W.data_ptr()
                    and self._fits(x, W)):
                y = self._linear(x, W, None)
                out = kwargs.get("out")
                return y if out is None else out.copy_(y)
        return func(*args, **kwargs)


def fast_products(device=None, owner=None):
    """A context under which products with a model's float32 weights run through oneDNN (on a CPU;
    elsewhere, or with FFKV_ONEDNN=0, it does nothing). The packed weights live as long as the
    context, or, with `owner` (a model object), as long as the owner: a context entered per batch
    or per request (the explorer, the sentence encoder) packs them once, not each time."""
    if not enabled() or (device not in (None, "auto") and torch.device(device).type != "cpu"):
        return nullcontext()
    return _OneDNN(None if owner is None else owner.__dict__.setdefault("_ffkv_onednn_copies", {}))


@contextmanager
def products_of(mm):
    """`fast_products` for model `mm`'s device, its packed weights kept on `mm`."""
    with fast_products(getattr(mm, "device", None), owner=mm):
        yield
