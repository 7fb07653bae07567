"""autopar::fp8_cast_transpose: the FP8 cast of x^T, written C-contiguous (cast-with-transpose).

    data_t, inv_scale = torch.ops.autopar.fp8_cast_transpose(x, "e4m3" | "e5m2", rowwise, amax=None)

The backward GEMMs read the forward's operands the other way round (grad_input reads the weight, grad_weight
reads the activation and the gradient transposed), and torch._scaled_mm wants its first operand row-major and
its second column-major: this op casts and transposes in one pass. rowwise: one scale per row of x^T (per
column of x), shape (cols, 1); else a 0-d scale (`amax` as for fp8_cast_tensorwise). Triton on GPU (transposed
tiles for the tensorwise form; a column-strip kernel for the rowwise one), the torch reference elsewhere.
"""
from __future__ import annotations

import torch

from autopar.codegen.kernels import cast_tensorwise, reference
from autopar.codegen.kernels._launch import format_args, triton_module, use_triton
from autopar.fp8.formats import DTYPES

BM, BC = 64, 32


def triton_impl(x: torch.Tensor, fmt: str, rowwise: bool, amax: torch.Tensor | None = None, *,
                interpret: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernels on a 2-D x (on CPU tensors: interpreted)."""
    interpret = not x.is_cuda if interpret is None else interpret
    if not rowwise:
        return cast_tensorwise.triton_impl(x, fmt, amax, transpose=True, interpret=interpret)
    m, n = x.shape
    out = torch.empty((n, m), dtype=DTYPES[fmt], device=x.device)
    inv = torch.empty((n, 1), dtype=torch.float32, device=x.device)
    if n:
        with triton_module(interpret) as k:
            k.cast_cols_transpose_kernel[((n + BC - 1) // BC,)](x, out.view(torch.uint8), inv, m, n, x.stride(0),
                                                                x.stride(1), BM=BM, BC=BC, **format_args(fmt))
    return out, inv


@torch.library.custom_op("autopar::fp8_cast_transpose", mutates_args=())
def fp8_cast_transpose(x: torch.Tensor, fmt: str, rowwise: bool,
                       amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(x):
        return triton_impl(x, fmt, rowwise, amax)
    return reference.cast_transpose(x, fmt, rowwise, amax)


@fp8_cast_transpose.register_fake
def _fake(x, fmt, rowwise, amax=None):
    rows, cols = x.shape[1], x.shape[0]
    scale = (rows, 1) if rowwise else ()
    return (torch.empty((rows, cols), dtype=DTYPES[fmt], device=x.device),
            torch.empty(scale, dtype=torch.float32, device=x.device))


FP8_CAST_TRANSPOSE = torch.ops.autopar.fp8_cast_transpose.default

__all__ = ["FP8_CAST_TRANSPOSE", "fp8_cast_transpose", "triton_impl"]
