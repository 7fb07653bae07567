"""Run every FP8 cast kernel against the torch reference, bit for bit, on odd shapes (no multiple of any
block), one-row and one-column operands, zero rows, empty tensors, large and tiny magnitudes, bf16 and fp32,
row- and column-major inputs, a given amax, and every 4096th fp32 value from 400 to 448.

    TRITON_INTERPRET=1 python -m autopar.codegen.kernels.selfcheck       # CPU, Triton's interpreter
    python -m autopar.codegen.kernels.selfcheck --device cuda            # the kernels compiled for a GPU

Prints one JSON line: {"device", "interpreted", "checks", "mismatches": [...]} (and, interpreted, how many values
a naive kernel casting with a plain `.to(tl.float8e4nv)` gets wrong: a negative control); exits 1 on a mismatch. On CPU,
TRITON_INTERPRET=1 must be set before Triton is first imported: Triton decorates its own library functions
(tl.max, ...) for the interpreter only then.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from autopar.codegen.kernels import cast_rowwise, cast_tensorwise, cast_transpose, reference

SHAPES = [(37, 133), (1, 300), (130, 1), (70, 257)]
MAGNITUDES = [(1.0, torch.bfloat16), (3e4, torch.float32), (1e-30, torch.float32)]
FORMATS = ("e4m3", "e5m2")


def operand(shape, scale: float, dtype: torch.dtype, seed: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * scale
    if shape[0] > 2:
        x[1].zero_()  # an all-zero row: amax 0, the scale stays finite and the row casts to zeros
    return x.to(dtype).to(device)


def _differs(got, want) -> str | None:
    (gd, gs), (wd, ws) = got, want
    if gd.dtype != wd.dtype or gd.shape != wd.shape or not gd.is_contiguous():
        return f"data {gd.dtype}{list(gd.shape)} vs {wd.dtype}{list(wd.shape)}"
    n = int((gd.view(torch.uint8) != wd.view(torch.uint8)).sum())
    if n:
        return f"{n} of {wd.numel()} FP8 values differ"
    if gs.shape != ws.shape or not torch.equal(gs.view(torch.int32), ws.view(torch.int32)):
        return "scales differ"
    return None


def cases(device: str):
    """(name, kernel result thunk, reference thunk) for every check."""
    for i, (shape, (scale, dtype)) in enumerate((s, m) for s in SHAPES for m in MAGNITUDES):
        x = operand(shape, scale, dtype, i, device)
        for layout, src in (("row-major", x), ("column-major", x.t().contiguous().t())):
            for fmt in FORMATS:
                tag = f"{list(shape)} x{scale:g} {str(dtype)[6:]} {layout} {fmt}"
                yield (f"tensorwise {tag}", lambda s=src, f=fmt: cast_tensorwise.triton_impl(s, f),
                       lambda s=src, f=fmt: reference.cast_tensorwise(s, f))
                yield (f"rowwise {tag}", lambda s=src, f=fmt: cast_rowwise.triton_impl(s, f),
                       lambda s=src, f=fmt: reference.cast_rowwise(s, f))
                for rw in (False, True):
                    yield (f"transpose rowwise={rw} {tag}",
                           lambda s=src, f=fmt, r=rw: cast_transpose.triton_impl(s, f, r),
                           lambda s=src, f=fmt, r=rw: reference.cast_transpose(s, f, r))
    for shape in ((0, 16), (16, 0)):
        z = torch.zeros(shape, device=device)
        yield (f"tensorwise empty {list(shape)}", lambda z=z: cast_tensorwise.triton_impl(z, "e4m3"),
               lambda z=z: reference.cast_tensorwise(z, "e4m3"))
        yield (f"rowwise empty {list(shape)}", lambda z=z: cast_rowwise.triton_impl(z, "e4m3"),
               lambda z=z: reference.cast_rowwise(z, "e4m3"))
        yield (f"transpose empty {list(shape)}", lambda z=z: cast_transpose.triton_impl(z, "e4m3", True),
               lambda z=z: reference.cast_transpose(z, "e4m3", True))
    x = operand((33, 65), 10.0, torch.bfloat16, 7, device)
    amax = torch.tensor(500.0, device=device)  # an amax reduced over ranks, larger than this shard's own
    yield ("tensorwise given amax", lambda: cast_tensorwise.triton_impl(x, "e4m3", amax),
           lambda: reference.cast_tensorwise(x, "e4m3", amax))
    yield ("transpose given amax", lambda: cast_transpose.triton_impl(x, "e4m3", False, amax),
           lambda: reference.cast_transpose(x, "e4m3", False, amax))
    # 400.0 .. 448.0, every 4096th fp32 value, both signs: amax 448 makes the scale exactly 1, so the reference is
    # torch's own cast (where a plain `.to(tl.float8e4nv)` under the interpreter was one step off).
    top = torch.arange(0x43C80000, 0x43E00001, 4096, dtype=torch.int32).view(torch.float32)
    top = torch.cat([top, -top, torch.tensor([448.0])]).reshape(1, -1).to(device)
    yield ("tensorwise 400..448", lambda: cast_tensorwise.triton_impl(top, "e4m3"),
           lambda: (top.to(torch.float8_e4m3fn), torch.tensor(1.0, device=device)))


def naive_control(device: str) -> int:
    """How many values a kernel with a plain `.to(tl.float8e4nv)` (no rounding of its own) casts differently from
    torch: a negative control showing the comparison sees a one-step rounding difference."""
    import triton
    import triton.language as tl

    @triton.jit
    def plain_cast(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
        tl.store(out_ptr + offs, x.to(tl.float8e4nv).to(tl.uint8, bitcast=True), mask=offs < n)

    x = torch.linspace(-448, 448, 4097, device=device)
    out = torch.empty(x.shape, dtype=torch.uint8, device=device)
    plain_cast[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    return int((out != x.to(torch.float8_e4m3fn).view(torch.uint8)).sum())


def run(device: str) -> dict:
    from autopar.codegen.kernels._launch import triton_module

    with triton_module(device != "cuda") as mod:
        interpreted = mod.INTERPRETED
    mismatches, checks = [], 0
    for name, got, want in cases(device):
        checks += 1
        try:
            err = _differs(got(), want())
        except Exception as e:  # noqa: BLE001 - report the kernel that failed to run
            err = f"raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if err:
            mismatches.append(f"{name}: {err}")
    out = {"device": device, "interpreted": interpreted, "checks": checks, "mismatches": mismatches}
    if interpreted:
        out["naive_control_mismatches"] = naive_control(device)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    a = ap.parse_args()
    if a.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("set TRITON_INTERPRET=1 to run the kernels on CPU (Triton's interpreter)")
    result = run(a.device)
    print(json.dumps(result))
    sys.exit(1 if result["mismatches"] else 0)


if __name__ == "__main__":
    main()
