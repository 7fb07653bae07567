"""autopar::fp8_cast_rowwise: fused amax + scale + cast with one scale per row of a 2-D tensor.

    data, inv_scale = torch.ops.autopar.fp8_cast_rowwise(x, "e4m3" | "e5m2")

data: x in FP8 (C-contiguous); inv_scale: (rows, 1) fp32 (x[i] ~ data[i] * inv[i]). A row is the contraction
dim of the GEMM operand it feeds, so torch._scaled_mm takes the scales as they are. One Triton kernel on GPU
(a row's second read hits cache), the torch reference elsewhere.
"""
from __future__ import annotations

import torch

from autopar.codegen.kernels import reference
from autopar.codegen.kernels._launch import format_args, triton_module, use_triton
from autopar.fp8.formats import DTYPES

BR, BN = 16, 256


def triton_impl(x: torch.Tensor, fmt: str, *, interpret: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel on a 2-D x (on CPU tensors: interpreted)."""
    m, n = x.shape
    out = torch.empty((m, n), dtype=DTYPES[fmt], device=x.device)
    inv = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        with triton_module(not x.is_cuda if interpret is None else interpret) as k:
            k.cast_rows_kernel[((m + BR - 1) // BR,)](x, out.view(torch.uint8), inv, m, n, x.stride(0),
                                                      x.stride(1), BR=BR, BN=BN, **format_args(fmt))
    return out, inv


@torch.library.custom_op("autopar::fp8_cast_rowwise", mutates_args=())
def fp8_cast_rowwise(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(x):
        return triton_impl(x, fmt)
    return reference.cast_rowwise(x, fmt)


@fp8_cast_rowwise.register_fake
def _fake(x, fmt):
    return (torch.empty(x.shape, dtype=DTYPES[fmt], device=x.device),
            torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device))


FP8_CAST_ROWWISE = torch.ops.autopar.fp8_cast_rowwise.default

__all__ = ["FP8_CAST_ROWWISE", "fp8_cast_rowwise", "triton_impl"]
