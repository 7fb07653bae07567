"""Time of an FP8 matmul on one device: the GEMM at the FP8 peak plus the memory traffic of its scale and cast
kernels, each with a kernel floor.

A cast kernel is memory bound. Tensorwise scaling takes two kernels: one reads the operand for its amax, one
reads it again, computes the scale and writes the FP8 copy. Rowwise scaling takes one kernel per row block: a
row is read for its amax and read again from cache for the cast; a transposed rowwise cast (scales per column of
its input, the backward's layout) walks columns longer than a cache holds, so it reads the operand twice from
memory. A transposed tensorwise cast moves the same bytes as a plain one (the tile is transposed on chip).
"""
from __future__ import annotations

from autopar.cost.hardware import HardwareSpec, peak_flops_for

# The shortest a kernel takes however little it moves: launch on the stream and one wave of blocks. NVIDIA
# GPUs finish an elementwise kernel over a few KiB in about 2-5 us (Nsight timelines of small kernels on A100 and
# H100); a CPU rank pays a Python-dispatched op, ~20 us.
KERNEL_FLOOR_S = {"h100": 3e-6, "h200": 3e-6, "a100": 3e-6, "cpu": 2e-5}
_DEFAULT_FLOOR = 3e-6
SCALE_BYTES = 4  # fp32 scales
# The rowwise-scaled GEMM (a CUTLASS kernel in torch._scaled_mm) runs below the tensorwise one (cuBLAS): "most
# shapes are within 90-100% of tensor-wise efficiency, but there's a long tail going down to 50%"
# (pytorch/pytorch#147971, H100, fast accumulation). The lower end of the common range is used.
ROWWISE_GEMM_EFFICIENCY = 0.9


def has_fp8(hw: HardwareSpec) -> bool:
    """Whether the device has FP8 tensor cores (a figure for an FP8 dtype in its table)."""
    return any("float8" in str(d) for d in hw.peak_flops)


def kernel_time(nbytes: float, hw: HardwareSpec) -> float:
    """One memory-bound kernel: its bytes at the memory bandwidth, never below the kernel floor."""
    return max(nbytes / hw.hbm_bandwidth, KERNEL_FLOOR_S.get(hw.name, _DEFAULT_FLOOR))


def cast_time(rows: int, cols: int, src_itemsize: int, scaling: str, transpose: bool, hw: HardwareSpec) -> float:
    """amax + scale + cast of a rows x cols operand (its FP8 copy written rows x cols, or transposed)."""
    n = rows * cols
    if n == 0:
        return 0.0
    if scaling == "tensorwise":
        return kernel_time(n * src_itemsize, hw) + kernel_time(n * src_itemsize + n + SCALE_BYTES, hw)
    reads = 2 if transpose else 1
    scales = (cols if transpose else rows) * SCALE_BYTES
    return kernel_time(reads * n * src_itemsize + n + scales, hw)


def fp8_gemm_time(m: int, k: int, n: int, out_itemsize: int, hw: HardwareSpec, plain_dtype,
                  rowwise: bool = False) -> float:
    """The (m, k) x (k, n) GEMM on FP8 operands: at the FP8 peak (rowwise scaling: ROWWISE_GEMM_EFFICIENCY of
    it), or, on a device without FP8 (the CPU, where torch._scaled_mm still runs), at the rate of the matmul's
    own dtype."""
    flops = 2.0 * m * k * n
    if has_fp8(hw):
        import torch

        peak = peak_flops_for(hw, torch.float8_e4m3fn) * (ROWWISE_GEMM_EFFICIENCY if rowwise else 1.0)
    else:
        peak = peak_flops_for(hw, plain_dtype)
    nbytes = m * k + k * n + m * n * out_itemsize
    return max(flops / peak, nbytes / hw.hbm_bandwidth)


def fp8_copy_time(numel: int, hw: HardwareSpec) -> float:
    """A transposed copy of an FP8 tensor (read and write one byte per element)."""
    return kernel_time(2 * numel, hw) if numel else 0.0


__all__ = ["KERNEL_FLOOR_S", "ROWWISE_GEMM_EFFICIENCY", "has_fp8", "kernel_time", "cast_time", "fp8_gemm_time", "fp8_copy_time"]
