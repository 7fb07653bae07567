"""On a GPU: the FP8 cast kernels' bandwidth against torch.compile'd casts, and the real speedup of one linear's
GEMMs in FP8 (forward and both backward GEMMs, with their casts) against the cost model's prediction.

Usage (a CUDA device with FP8, torch with triton): python benchmarks/fp8_gpu.py [--quick]
On a CPU (no timing worth reading, checks that the script runs): python benchmarks/fp8_gpu.py --smoke

Times are medians of CUDA-event-timed repetitions after warm-up. Bandwidth counts the bytes each kernel must move
(read the bf16 operand, write its FP8 copy; tensorwise reads twice) over the measured time.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def _timer(device: str, fn, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def casts(device: str, shapes, reps: int) -> None:
    from autopar.codegen.kernels import cast_rowwise, cast_tensorwise, cast_transpose, reference

    compiled = {name: torch.compile(fn) if device == "cuda" else fn for name, fn in (
        ("tensorwise", lambda x: reference.cast_tensorwise(x, "e4m3")),
        ("rowwise", lambda x: reference.cast_rowwise(x, "e4m3")),
        ("transpose rowwise", lambda x: reference.cast_transpose(x, "e4m3", True)))}
    ours = {"tensorwise": lambda x: cast_tensorwise.triton_impl(x, "e4m3", interpret=device != "cuda"),
            "rowwise": lambda x: cast_rowwise.triton_impl(x, "e4m3", interpret=device != "cuda"),
            "transpose rowwise": lambda x: cast_transpose.triton_impl(x, "e4m3", True, interpret=device != "cuda")}
    reads = {"tensorwise": 2, "rowwise": 1, "transpose rowwise": 1}
    print("FP8 casts of a bf16 operand: autopar's Triton kernels vs torch.compile of the reference (GB/s)")
    print(f"{'shape':>14} {'cast':>18} {'autopar':>9} {'compiled':>9}  same bits")
    for shape in shapes:
        x = torch.randn(shape, device=device).to(torch.bfloat16)
        for name in ours:
            nbytes = x.numel() * (2 * reads[name] + 1)
            t_ours = _timer(device, lambda: ours[name](x), reps)
            t_ref = _timer(device, lambda: compiled[name](x), reps)
            (a, sa), (b, sb) = ours[name](x), compiled[name](x)
            same = torch.equal(a.view(torch.uint8), b.view(torch.uint8)) and torch.equal(sa, sb)
            print(f"{str(shape):>14} {name:>18} {nbytes / t_ours / 1e9:9.0f} {nbytes / t_ref / 1e9:9.0f}  {same}")


def _rows(x: torch.Tensor, fmt: str, rowwise: bool):
    """FP8 rows of x, C-contiguous, with autopar's ops (Triton on CUDA), as codegen/fp8.py casts an operand."""
    from autopar.codegen.kernels import FP8_CAST_ROWWISE, FP8_CAST_TENSORWISE, FP8_CAST_TRANSPOSE

    if not x.is_contiguous() and x.t().is_contiguous():
        return FP8_CAST_TRANSPOSE(x.t(), fmt, rowwise)
    return FP8_CAST_ROWWISE(x, fmt) if rowwise else FP8_CAST_TENSORWISE(x, fmt)


def fp8_matmul(a, b, a_fmt: str, b_fmt: str, rowwise: bool, out_dtype):
    from autopar import _torch_compat as compat

    ra, sa = _rows(a, a_fmt, rowwise)
    rb, sb = _rows(b.t(), b_fmt, rowwise)
    return compat.scaled_mm_op()(ra, rb.t(), sa, sb.t() if rowwise else sb, out_dtype=out_dtype)


def gemms(device: str, shapes, reps: int) -> None:
    from autopar.cost import get_hardware

    import importlib.util
    import pathlib

    spec = importlib.util.spec_from_file_location("fp8_gain", pathlib.Path(__file__).with_name("fp8_gain.py"))
    gain = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gain)
    hw = get_hardware("h100" if device == "cuda" else "cpu")
    print("\nOne linear, forward + backward GEMMs (bf16 vs FP8 with autopar's casts): measured vs predicted speedup")
    print(f"{'M, K, N':>20} {'bf16 ms':>8} {'tw ms':>7} {'rw ms':>7} {'tw x':>6} {'pred':>6} {'rw x':>6} {'pred':>6}")
    for m, k, n in shapes:
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
        gy = torch.randn(m, n, device=device, dtype=torch.bfloat16)

        def plain():
            return x @ w.t(), gy @ w, gy.t() @ x

        def fp8(rowwise):
            return (fp8_matmul(x, w.t(), "e4m3", "e4m3", rowwise, torch.bfloat16),
                    fp8_matmul(gy, w, "e5m2", "e4m3", rowwise, torch.bfloat16),
                    fp8_matmul(gy.t(), x, "e5m2", "e4m3", rowwise, torch.bfloat16))

        t_bf16 = _timer(device, plain, reps)
        t_tw = _timer(device, lambda: fp8(False), reps)
        t_rw = _timer(device, lambda: fp8(True), reps)
        pred = gain.linear_times(m, k, n, hw)
        print(f"{f'{m}, {k}, {n}':>20} {t_bf16 * 1e3:8.3f} {t_tw * 1e3:7.3f} {t_rw * 1e3:7.3f} "
              f"{t_bf16 / t_tw:6.2f} {pred['bf16'] / pred['fp8 tensorwise']:6.2f} {t_bf16 / t_rw:6.2f} "
              f"{pred['bf16'] / pred['fp8 rowwise']:6.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer shapes and repetitions")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script, times nothing")
    a = ap.parse_args()
    if a.smoke:
        casts("cpu", [(64, 96)], 1)
        gemms("cpu", [(64, 64, 64)], 1)
        return
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --smoke to check the script on a CPU")
    reps = 10 if a.quick else 50
    cast_shapes = [(8192, 4096), (16384, 8192)] if a.quick else [(4096, 4096), (8192, 4096), (8192, 14336),
                                                                (16384, 8192)]
    gemm_shapes = [(1024, 2048, 1024), (4096, 8192, 16384)] if a.quick else [
        (1024, 2048, 1024), (4096, 4096, 4096), (8192, 4096, 14336), (4096, 8192, 16384), (16384, 8192, 8192)]
    casts("cuda", cast_shapes, reps)
    gemms("cuda", gemm_shapes, reps)


if __name__ == "__main__":
    main()
