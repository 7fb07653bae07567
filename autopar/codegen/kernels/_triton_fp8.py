"""Triton kernels behind autopar's FP8 cast ops (imported only when a kernel runs: on CUDA tensors, or on CPU
under the Triton interpreter, see autopar.codegen.kernels.triton_module).

Each kernel reproduces autopar/codegen/kernels/reference.py bit for bit. The cast to FP8 rounds in fp32
arithmetic first (round-half-to-even onto the format's grid), so the final conversion only re-encodes a value the
format holds exactly and its rounding mode cannot matter: Triton's interpreter converts fp32 to FP8 by truncating
and adding the first dropped bit, without carrying into the exponent (1.99 -> 1.0 in E4M3), where torch and the
GPU round to nearest even; a plain `.to(tl.float8e4nv)` therefore differs from torch. Division is `div_rn`
(IEEE), never the approximate `/`; offsets are int64, so tensors past 2^31 elements index correctly; nan is written as its canonical bits, since GPU min/max drop nan; and every
`where` with a Python float is cast back to fp32, since the interpreter would otherwise carry on in float64.
"""
from __future__ import annotations

import triton
import triton.language as tl

@triton.jit
def _fp8_bits(y, FP8: tl.constexpr, MANT: tl.constexpr, MIN_EXP: tl.constexpr, FMAX: tl.constexpr):
    """fp32 y (already scaled) -> uint8 bits of its FP8 value: clamp, round to nearest even, encode."""
    nan = y != y
    c = tl.minimum(tl.maximum(y, -FMAX), FMAX)
    a = tl.abs(c)
    e = tl.maximum((a.to(tl.int32, bitcast=True) >> 23) - 127, MIN_EXP)
    # 2^(e - MANT + 23): adding it puts the grid step of |c| at the last fp32 bit, so fp32's own
    # round-to-nearest-even rounds onto the FP8 grid; subtracting it is exact.
    big = ((e - MANT + 23 + 127) << 23).to(tl.float32, bitcast=True)
    r = (a + big) - big
    r = tl.where(c.to(tl.int32, bitcast=True) < 0, -r, r)
    bits = r.to(FP8, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
    return tl.where(nan, 0x7F, bits).to(tl.uint8)


@triton.jit
def _scale(amax, FMAX: tl.constexpr, EPS: tl.constexpr):
    """fp32 scale from an fp32 amax: FMAX / max(amax, EPS), nan when amax is inf or nan."""
    finite = tl.abs(amax) < float("inf")
    s = tl.math.div_rn(tl.zeros_like(amax) + FMAX, tl.maximum(amax, EPS))
    return tl.where(finite, s, float("nan")).to(tl.float32)


@triton.jit
def _block_amax(x, mask, AXIS: tl.constexpr):
    """max |x| of a block (along AXIS), nan where the block holds a nan."""
    ax = tl.where(mask, tl.abs(x), 0.0).to(tl.float32)
    m = tl.max(ax, axis=AXIS)
    has_nan = tl.max(tl.where(mask & (x != x), 1, 0), axis=AXIS)
    return tl.where(has_nan > 0, float("nan"), m).to(tl.float32)


@triton.jit
def amax_kernel(x_ptr, amax_ptr, M, N, sxm, sxn, BM: tl.constexpr, BN: tl.constexpr):
    """amax_ptr[0] = max(amax_ptr[0], max |x| of this program's tile) (amax_ptr starts at 0)."""
    rm = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
    rn = (tl.program_id(1) * BN + tl.arange(0, BN)).to(tl.int64)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    x = tl.load(x_ptr + rm[:, None] * sxm + rn[None, :] * sxn, mask=mask, other=0.0).to(tl.float32)
    m = tl.max(tl.max(tl.where(mask, tl.abs(x), 0.0).to(tl.float32), axis=1), axis=0)
    nan_in = tl.max(tl.max(tl.where(mask & (x != x), 1, 0), axis=1), axis=0)
    tl.atomic_max(amax_ptr, tl.where(nan_in > 0, float("nan"), m).to(tl.float32))


@triton.jit
def cast_tensorwise_kernel(x_ptr, out_ptr, amax_ptr, inv_ptr, M, N, sxm, sxn, FP8: tl.constexpr,
                           MANT: tl.constexpr, MIN_EXP: tl.constexpr, FMAX: tl.constexpr, EPS: tl.constexpr,
                           TRANSPOSE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """out = FP8 cast of x (M x N) with one scale from amax_ptr; TRANSPOSE: out is x^T (N x M), written as
    transposed tiles so loads and stores both run along contiguous memory."""
    pm, pn = tl.program_id(0), tl.program_id(1)
    scale = _scale(tl.load(amax_ptr), FMAX, EPS)
    if (pm == 0) & (pn == 0):
        tl.store(inv_ptr, tl.math.div_rn(tl.zeros_like(scale) + 1.0, scale))
    rm = (pm * BM + tl.arange(0, BM)).to(tl.int64)
    rn = (pn * BN + tl.arange(0, BN)).to(tl.int64)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    x = tl.load(x_ptr + rm[:, None] * sxm + rn[None, :] * sxn, mask=mask, other=0.0).to(tl.float32)
    bits = _fp8_bits(x * scale, FP8, MANT, MIN_EXP, FMAX)
    if TRANSPOSE:
        tl.store(out_ptr + rn[:, None] * M + rm[None, :], tl.trans(bits), mask=tl.trans(mask))
    else:
        tl.store(out_ptr + rm[:, None] * N + rn[None, :], bits, mask=mask)


@triton.jit
def cast_rows_kernel(x_ptr, out_ptr, inv_ptr, M, N, sxm, sxn, FP8: tl.constexpr, MANT: tl.constexpr,
                     MIN_EXP: tl.constexpr, FMAX: tl.constexpr, EPS: tl.constexpr, BR: tl.constexpr,
                     BN: tl.constexpr):
    """Rowwise: BR rows per program, one scale per row; the second pass over a row hits cache."""
    rm = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    amax = tl.zeros((BR,), dtype=tl.float32)
    for start in range(0, N, BN):
        rn = (start + tl.arange(0, BN)).to(tl.int64)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        x = tl.load(x_ptr + rm[:, None] * sxm + rn[None, :] * sxn, mask=mask, other=0.0).to(tl.float32)
        b = _block_amax(x, mask, 1)
        amax = tl.where((b != b) | (amax != amax), float("nan"), tl.maximum(amax, b)).to(tl.float32)
    scale = _scale(amax, FMAX, EPS)
    tl.store(inv_ptr + rm, tl.math.div_rn(tl.zeros_like(scale) + 1.0, scale), mask=rm < M)
    for start in range(0, N, BN):
        rn = (start + tl.arange(0, BN)).to(tl.int64)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        x = tl.load(x_ptr + rm[:, None] * sxm + rn[None, :] * sxn, mask=mask, other=0.0).to(tl.float32)
        bits = _fp8_bits(x * scale[:, None], FP8, MANT, MIN_EXP, FMAX)
        tl.store(out_ptr + rm[:, None] * N + rn[None, :], bits, mask=mask)


@triton.jit
def cast_cols_transpose_kernel(x_ptr, out_ptr, inv_ptr, M, N, sxm, sxn, FP8: tl.constexpr, MANT: tl.constexpr,
                               MIN_EXP: tl.constexpr, FMAX: tl.constexpr, EPS: tl.constexpr, BM: tl.constexpr,
                               BC: tl.constexpr):
    """Rowwise cast of x^T: BC columns of x (M x N) per program, one scale per column, written as rows of the
    N x M output."""
    rn = (tl.program_id(0) * BC + tl.arange(0, BC)).to(tl.int64)
    amax = tl.zeros((BC,), dtype=tl.float32)
    for start in range(0, M, BM):
        rm = (start + tl.arange(0, BM)).to(tl.int64)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        x = tl.load(x_ptr + rm[:, None] * sxm + rn[None, :] * sxn, mask=mask, other=0.0).to(tl.float32)
        b = _block_amax(x, mask, 0)
        amax = tl.where((b != b) | (amax != amax), float("nan"), tl.maximum(amax, b)).to(tl.float32)
    scale = _scale(amax, FMAX, EPS)
    tl.store(inv_ptr + rn, tl.math.div_rn(tl.zeros_like(scale) + 1.0, scale), mask=rn < N)
    for start in range(0, M, BM):
        rm = (start + tl.arange(0, BM)).to(tl.int64)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        x = tl.load(x_ptr + rm[:, None] * sxm + rn[None, :] * sxn, mask=mask, other=0.0).to(tl.float32)
        bits = _fp8_bits(x * scale[None, :], FP8, MANT, MIN_EXP, FMAX)
        tl.store(out_ptr + rn[:, None] * M + rm[None, :], tl.trans(bits), mask=tl.trans(mask))


INTERPRETED = type(amax_kernel).__name__ == "InterpretedFunction"
