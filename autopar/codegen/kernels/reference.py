"""The torch reference of autopar's FP8 cast kernels: what they compute, bit for bit, on any device.

    amax    = max |x| over the tensor (tensorwise) or over each row of the output (rowwise), in fp32
    scale   = MAX / max(amax, EPS) if amax is finite, else nan          (fp32; MAX = 448 for E4M3, 57344 for E5M2)
    data    = round_to_nearest_even(clamp(x * scale, -MAX, MAX))        (an FP8 tensor, C-contiguous)
    inv     = 1 / scale                                                  (what torch._scaled_mm takes)

An amax of zero gives a finite scale (an all-zero operand casts to zeros); an inf or nan anywhere in the scaled
block makes its scale nan, so every value of that block casts to nan (bits 0x7F), and the matmul, the loss or
the gradients carry the nan to where the runtime checks them (Fp8Config.on_nonfinite).
"""
from __future__ import annotations

import torch

from autopar.fp8.formats import DTYPES, EPS, MAX

NAN_BITS = 0x7F  # the canonical nan of both formats (E4M3FN: S.1111.111, E5M2: S.11111.11), sign clear


def scale_of(amax: torch.Tensor, fmt: str) -> torch.Tensor:
    """fp32 scale(s) from fp32 amax(es): MAX / max(amax, EPS), nan where the amax is not finite."""
    amax = amax.float()
    # Tensor / tensor is IEEE division; `float / tensor` is reciprocal-then-multiply in torch (two roundings).
    scale = torch.full_like(amax, MAX[fmt]) / amax.clamp(min=EPS)
    return torch.where(torch.isfinite(amax), scale, torch.full_like(amax, float("nan")))


def inverse(scale: torch.Tensor) -> torch.Tensor:
    """1 / scale, one IEEE division (what torch._scaled_mm multiplies the FP8 products by)."""
    return torch.ones_like(scale) / scale


def quantize(x: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """x * scale (scale broadcast), clamped to the format's range, cast with round-to-nearest-even; nan -> 0x7F."""
    y = (x.float() * scale).clamp(-MAX[fmt], MAX[fmt])
    bits = y.to(DTYPES[fmt]).view(torch.uint8)
    bits = torch.where(torch.isnan(y), torch.full_like(bits, NAN_BITS), bits)
    return bits.view(DTYPES[fmt]).contiguous()


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| in fp32 as a 0-d tensor (0 for an empty tensor); nan if any value is nan."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return x.float().abs().amax()


def cast_tensorwise(x: torch.Tensor, fmt: str, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 data of x, 0-d inverse scale); `amax` given: use it (an amax already reduced over ranks)."""
    scale = scale_of(tensor_amax(x) if amax is None else amax.reshape(()), fmt)
    return quantize(x, scale, fmt), inverse(scale)


def cast_rowwise(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 data of x, inverse scales of shape (rows, 1)), one scale per row of the 2-D x."""
    rows = x.shape[0]
    if x.numel() == 0:
        amax = torch.zeros((rows, 1), dtype=torch.float32, device=x.device)
    else:
        amax = x.float().abs().amax(dim=1, keepdim=True)
    scale = scale_of(amax, fmt)
    return quantize(x, scale, fmt), inverse(scale)


def cast_transpose(x: torch.Tensor, fmt: str, rowwise: bool,
                   amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The cast of x^T, C-contiguous (what a GEMM operand needs when x is laid out the other way); rowwise: one
    scale per row of x^T, i.e. per column of x."""
    if rowwise:
        return cast_rowwise(x.t(), fmt)
    return cast_tensorwise(x.t(), fmt, amax)


__all__ = ["NAN_BITS", "scale_of", "inverse", "quantize", "tensor_amax", "cast_tensorwise", "cast_rowwise", "cast_transpose"]
