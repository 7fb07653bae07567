"""autopar's FP8 cast kernels: the Triton kernels (run by Triton's interpreter on CPU, compiled on a GPU) against
the torch reference bit for bit, the reference against the definition, and the ops' fake shapes and sharding
rules."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from autopar import _torch_compat as compat
from autopar.codegen.kernels import FP8_CAST_ROWWISE, FP8_CAST_TENSORWISE, FP8_CAST_TRANSPOSE, reference
from autopar.codegen.kernels import selfcheck
from autopar.codegen.kernels._launch import triton_available
from autopar.fp8.formats import DTYPES, MAX
from autopar.layout import R, S
from autopar.rules import AxisStrategy
from autopar.testing import rule_check

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")

# Odd shapes (not multiples of any block), one row and one column, and shapes spanning several blocks.
SHAPES = [(37, 133), (1, 300), (130, 1), (70, 257)]


def _operand(shape, scale, dtype, seed):
    return selfcheck.operand(shape, scale, dtype, seed, "cpu")


@pytest.mark.slow
@needs_triton
def test_triton_kernels_match_the_reference_bit_for_bit_under_the_interpreter():
    """Every kernel on odd shapes, one-row and one-column operands, zero rows, empty tensors, large (saturating)
    and tiny (subnormal fp32) magnitudes, bf16 and fp32, row- and column-major inputs, a given amax and the
    fp32 values 400..448 (autopar/codegen/kernels/selfcheck.py), under TRITON_INTERPRET=1 in a fresh process:
    Triton decorates its own library functions for the interpreter only when the variable is set before it is
    first imported, and this test process may have imported Triton already (torch and transformers do)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-m", "autopar.codegen.kernels.selfcheck"], env=env, capture_output=True,
                         text=True, timeout=600)
    result = json.loads(out.stdout.strip().splitlines()[-1]) if out.stdout.strip() else {}
    assert result, out.stderr[-3000:]
    assert result["interpreted"] and result["checks"] == 201, result
    assert not result["mismatches"], "\n".join(result["mismatches"][:20])
    assert result["naive_control_mismatches"] > 0  # a plain .to(tl.float8e4nv) would have been caught


def test_reference_follows_the_definition():
    x = _operand((8, 32), 5.0, torch.float32, 1)
    data, inv = reference.cast_tensorwise(x, "e4m3")
    amax = x.abs().max()
    scale = torch.tensor(MAX["e4m3"]) / amax
    assert torch.equal(inv, torch.tensor(1.0) / scale)
    assert torch.equal(data.view(torch.uint8), (x * scale).clamp(-448, 448).to(DTYPES["e4m3"]).view(torch.uint8))
    assert (data.float() * inv - x).abs().max() <= amax * 2 ** -4  # within half an E4M3 step of the largest value
    data, inv = reference.cast_rowwise(x, "e5m2")
    assert inv.shape == (8, 1) and data.dtype == torch.float8_e5m2
    assert data.float().abs().amax(1).eq(MAX["e5m2"]).all() or x[1].abs().max() == 0


def test_zero_and_nonfinite_inputs():
    zeros = torch.zeros(4, 16)
    data, inv = reference.cast_tensorwise(zeros, "e4m3")
    assert torch.isfinite(inv) and data.float().eq(0).all()  # amax 0: finite scale, zeros out
    data, inv = reference.cast_rowwise(zeros, "e5m2")
    assert torch.isfinite(inv).all() and data.float().eq(0).all()
    for bad in (float("inf"), float("nan")):
        x = torch.ones(4, 16)
        x[2, 3] = bad
        data, inv = reference.cast_tensorwise(x, "e4m3")  # the whole tensor's scale is nan: every value nan
        assert data.float().isnan().all() and inv.isnan()
        data, inv = reference.cast_rowwise(x, "e4m3")  # only that row's scale
        assert data[2].float().isnan().all() and not data[[0, 1, 3]].float().isnan().any()
        b = torch.ones(8, 16).to(torch.float8_e4m3fn)
        out = compat.scaled_mm_op()(data, b.t(), inv, torch.ones(1, 8), out_dtype=torch.bfloat16)
        assert out[2].isnan().all() and not out[[0, 1, 3]].isnan().any()  # the matmul carries it on


def test_ops_have_fake_shapes_and_run_the_reference_on_cpu():
    x = _operand((32, 48), 2.0, torch.bfloat16, 3)
    for op, args, shapes in ((FP8_CAST_TENSORWISE, ("e4m3",), [(32, 48), ()]),
                             (FP8_CAST_ROWWISE, ("e5m2",), [(32, 48), (32, 1)]),
                             (FP8_CAST_TRANSPOSE, ("e4m3", True), [(48, 32), (48, 1)]),
                             (FP8_CAST_TRANSPOSE, ("e4m3", False), [(48, 32), ()])):
        real = op(x, *args)
        with compat.fake_tensor_mode() as mode:
            fake = op(mode.from_tensor(x), *args)
        assert [tuple(t.shape) for t in real] == [tuple(t.shape) for t in fake] == shapes
        assert [t.dtype for t in real] == [t.dtype for t in fake]


def test_a_wrong_cast_rule_fails_the_execution_check():
    """Negative control: a tensorwise cast of shards with each shard's own amax is not the cast of the whole."""
    x = _operand((8, 16), 50.0, torch.float32, 5)
    wrong = [AxisStrategy((S(0),), (S(0), R))]
    errors = rule_check.check_call(FP8_CAST_TENSORWISE, (x, "e4m3"), {}, 2, strategies=wrong)
    assert errors and "FP8 values differ" in errors[0], errors


# --- on a GPU (skipped without one): the kernels compiled for real ------------------------------------------
gpu = pytest.mark.skipif(not torch.cuda.is_available() or not triton_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@gpu
def test_compiled_kernels_match_the_reference_on_gpu():
    result = selfcheck.run("cuda")
    assert not result["interpreted"] and result["checks"] == 201
    assert not result["mismatches"], "\n".join(result["mismatches"][:20])


@pytest.mark.gpu
@gpu
def test_ops_dispatch_to_triton_on_gpu_and_feed_scaled_mm():
    x = _operand((256, 512), 3.0, torch.bfloat16, 11).cuda()
    w = _operand((384, 512), 0.05, torch.bfloat16, 12).cuda()
    a, sa = FP8_CAST_ROWWISE(x, "e4m3")
    b, sb = FP8_CAST_ROWWISE(w, "e4m3")
    out = compat.scaled_mm_op()(a, b.t(), sa, sb.t(), out_dtype=torch.bfloat16)
    ref = x.float() @ w.float().t()
    assert ((out.float() - ref).norm() / ref.norm()).item() < 0.05
