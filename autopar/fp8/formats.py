"""The two FP8 formats autopar uses and the `torch._scaled_mm` rules a matmul must meet to run in them."""
from __future__ import annotations

import torch

E4M3 = "e4m3"  # activations and weights: 3 mantissa bits, max 448
E5M2 = "e5m2"  # gradients: 2 mantissa bits, max 57344 (the range gradients need)
DTYPES = {E4M3: torch.float8_e4m3fn, E5M2: torch.float8_e5m2}
MAX = {E4M3: 448.0, E5M2: 57344.0}
# Fewest significand bits and the smallest normal exponent of each format (the rounding grid of a cast).
MANTISSA_BITS = {E4M3: 3, E5M2: 2}
MIN_NORMAL_EXP = {E4M3: -6, E5M2: -14}
# The amax floor: an all-zero operand gets a finite scale (MAX / EPS) and casts to zeros.
EPS = 1e-12
# CUDA's _scaled_mm (cuBLASLt, and the CUTLASS rowwise kernel) wants every dimension a multiple of 16.
DIM_MULTIPLE = 16


def dims_ok(m: int, k: int, n: int) -> bool:
    """Whether a local (m, k) x (k, n) GEMM meets _scaled_mm's dimension rule."""
    return all(d > 0 and d % DIM_MULTIPLE == 0 for d in (m, k, n))


def formats_ok(a_fmt: str, b_fmt: str, rowwise: bool, out_dtype: torch.dtype) -> bool:
    """Operand formats and output dtype _scaled_mm accepts on CUDA: never two E5M2 operands (cuBLASLt); rowwise
    scales only with a bf16 output and an E4M3 second operand (the CUTLASS rowwise kernel)."""
    if a_fmt == E5M2 and b_fmt == E5M2:
        return False
    if rowwise:
        return out_dtype == torch.bfloat16 and b_fmt == E4M3
    return out_dtype in (torch.bfloat16, torch.float32, torch.float16)
