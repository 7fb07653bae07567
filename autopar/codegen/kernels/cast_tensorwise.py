"""autopar::fp8_cast_tensorwise: fused amax + scale + cast with one scale for the whole tensor.

    data, inv_scale = torch.ops.autopar.fp8_cast_tensorwise(x, "e4m3" | "e5m2", amax=None)

data: x in FP8 (C-contiguous, x's shape); inv_scale: 0-d fp32, what torch._scaled_mm takes (x ~ data * inv).
`amax` (a 0-d fp32 tensor) replaces x's own amax, for a shard cast with the amax of the whole tensor (FP8
all-gather). On GPU two Triton kernels run (the amax, then scale + cast); elsewhere the torch reference.
"""
from __future__ import annotations

import torch

from autopar.codegen.kernels import reference
from autopar.codegen.kernels._launch import format_args, triton_module, use_triton
from autopar.fp8.formats import DTYPES

BM, BN = 32, 128


def triton_impl(x: torch.Tensor, fmt: str, amax: torch.Tensor | None = None, *, transpose: bool = False,
                interpret: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernels on a 2-D x (on CPU tensors: interpreted). transpose: cast x^T (fp8_cast_transpose)."""
    m, n = x.shape
    out = torch.empty((n, m) if transpose else (m, n), dtype=DTYPES[fmt], device=x.device)
    inv = torch.empty((), dtype=torch.float32, device=x.device)
    with triton_module(not x.is_cuda if interpret is None else interpret) as k:
        if amax is None:
            amax = torch.zeros((), dtype=torch.float32, device=x.device)
            if x.numel():
                k.amax_kernel[(triton_cdiv(m, BM), triton_cdiv(n, BN))](x, amax, m, n, x.stride(0), x.stride(1),
                                                                         BM=BM, BN=BN)
        else:
            amax = amax.reshape(()).float().contiguous()
        grid = (max(triton_cdiv(m, BM), 1), max(triton_cdiv(n, BN), 1))
        k.cast_tensorwise_kernel[grid](x, out.view(torch.uint8), amax, inv, m, n, x.stride(0), x.stride(1),
                                       TRANSPOSE=transpose, BM=BM, BN=BN, **format_args(fmt))
    return out, inv


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


@torch.library.custom_op("autopar::fp8_cast_tensorwise", mutates_args=())
def fp8_cast_tensorwise(x: torch.Tensor, fmt: str, amax: torch.Tensor | None = None) -> tuple[torch.Tensor,
                                                                                              torch.Tensor]:
    if use_triton(x) and x.dim() == 2:
        return triton_impl(x, fmt, amax)
    return reference.cast_tensorwise(x, fmt, amax)


@fp8_cast_tensorwise.register_fake
def _fake(x, fmt, amax=None):
    return (torch.empty(x.shape, dtype=DTYPES[fmt], device=x.device),
            torch.empty((), dtype=torch.float32, device=x.device))


FP8_CAST_TENSORWISE = torch.ops.autopar.fp8_cast_tensorwise.default

__all__ = ["FP8_CAST_TENSORWISE", "fp8_cast_tensorwise", "triton_impl"]
