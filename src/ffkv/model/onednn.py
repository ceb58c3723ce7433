"""Float32 products with a model's weights through oneDNN instead of MKL, on a CPU.

Why: on this project's AMD (Zen) CPUs, torch's MKL sgemm runs a generic path at about half the
speed of oneDNN's kernels on the same float32 shapes (measured: SmolLM2's forward 1.8× faster on
one session's VM, 1.4× on another: the gain depends on the CPU),
and the forward passes and vocabulary projections are 80% of the steps after mining. Results
change by float rounding only (a test holds them to MKL's within float32 tolerance, and a row's
result to its result in another batch).

`fast_products()` is a scoped mode: inside it `F.linear(x, W, b)` and `x @ W.T` with W a model
parameter (a Linear's weight, the unembedding) run oneDNN's linear on a cached oneDNN copy of W;
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


def enabled() -> bool:
    return os.environ.get("FFKV_ONEDNN", "1") != "0" and torch.backends.mkldnn.is_available()


class _OneDNN(TorchFunctionMode):
    """Routes products with parameters to oneDNN; keeps each parameter's oneDNN copy while the mode
    lives (checked against the parameter's identity and version, so an edited weight is re-copied)."""

    def __init__(self):
        super().__init__()
        self.copies: dict[int, tuple] = {}

    def _weight(self, W: torch.Tensor):
        e = self.copies.get(id(W))
        if e is None or e[0] is not W or e[1] != W._version:
            e = self.copies[id(W)] = (W, W._version, W.detach().contiguous().to_mkldnn())
        return e[2]

    @staticmethod
    def _fits(x, W, b=None) -> bool:
        ok = (isinstance(W, torch.nn.Parameter) and isinstance(x, torch.Tensor) and x.dim() >= 2
              and x.dtype == W.dtype == torch.float32 and x.device.type == W.device.type == "cpu"
              and x.layout == torch.strided and x.numel() > 0 and x.shape[-1] == W.shape[1]
              and not (torch.is_grad_enabled() and (x.requires_grad or W.requires_grad)))
        return ok and (b is None or (isinstance(b, torch.Tensor) and b.dtype == torch.float32
                                     and b.device.type == "cpu" and b.dim() == 1 and not b.requires_grad))

    def _linear(self, x, W, b):
        shape = x.shape
        y = torch._C._nn.mkldnn_linear(x.reshape(-1, shape[-1]).contiguous().to_mkldnn(), self._weight(W),
                                       None if b is None else b.detach().contiguous())
        return y.to_dense().view(*shape[:-1], W.shape[0])

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


def fast_products(device=None):
    """A context under which products with a model's float32 weights run through oneDNN (on a CPU;
    elsewhere, or with FFKV_ONEDNN=0, it does nothing)."""
    if not enabled() or (device not in (None, "auto") and torch.device(device).type != "cpu"):
        return nullcontext()
    return _OneDNN()


@contextmanager
def products_of(mm):
    """`fast_products` for model `mm`'s device."""
    with fast_products(getattr(mm, "device", None)):
        yield
