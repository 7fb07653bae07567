"""Exact-value tests of the cost model: FLOPs, bytes, roofline times, collective times and training memory."""
import dataclasses

import pytest
import torch
from torch.utils.flop_counter import flop_registry

from autopar.cost import (CPU_DEFAULT, GPU_DEFAULT, HARDWARE, TrainingPrecision, collective_time, compute_copy_bytes,
                          compute_time, compute_time_sharded, get_hardware, link_spec, op_bytes, op_flops,
                          param_state_bytes, peak_flops_for, tensor_bytes)
from autopar.rules.base import OpInfo, TensorMeta

aten = torch.ops.aten
BF16, F32 = torch.bfloat16, torch.float32
H100 = get_hardware("h100")


def T(*shape, dtype=BF16):
    return TensorMeta(tuple(shape), dtype)


def op(target, args, outputs, kwargs=None):
    inputs = tuple(a for a in (*args, *(kwargs or {}).values()) if isinstance(a, TensorMeta))
    return OpInfo(target=target, args=tuple(args), kwargs=dict(kwargs or {}), inputs=inputs, outputs=tuple(outputs))


# ---- hardware ----------------------------------------------------------------------------------------------------

def test_hardware_table_figures():
    assert peak_flops_for(H100, BF16) == 989e12
    assert peak_flops_for(H100, torch.float8_e4m3fn) == 1979e12
    assert peak_flops_for(H100, torch.float8_e5m2) == 1979e12
    assert peak_flops_for(H100, F32) == 67e12
    assert H100.hbm_bandwidth == 3.35e12 and H100.memory_bytes == 80 * 2**30
    h200 = get_hardware("h200")
    assert h200.peak_flops == H100.peak_flops and h200.hbm_bandwidth == 4.8e12 and h200.memory_bytes == 141e9
    a100 = get_hardware("a100")
    assert peak_flops_for(a100, BF16) == 312e12 and peak_flops_for(a100, F32) == 19.5e12
    assert a100.hbm_bandwidth == 2.039e12 and a100.links["nvlink"].bandwidth == 300e9
    assert H100.links["nvlink"].bandwidth == 450e9 and H100.links["ib"].bandwidth == 50e9
    assert H100.links["pcie"].bandwidth == 32e9
    assert get_hardware("cpu").links["loopback"].bandwidth == 5e8


def test_get_hardware_is_case_insensitive():
    assert get_hardware("H100") is HARDWARE["h100"]


def test_unknown_device_lists_known_names():
    with pytest.raises(ValueError) as e:
        get_hardware("h900")
    assert str(e.value) == "unknown device 'h900'; known devices: a100, cpu, h100, h200"


def test_fp8_on_a100_raises():
    with pytest.raises(ValueError, match="'a100' has no FP8"):
        peak_flops_for(get_hardware("a100"), torch.float8_e4m3fn)


def test_dtype_fallbacks():
    cpu = dataclasses.replace(get_hardware("cpu"), peak_flops={F32: 1e10, BF16: 3e10})
    assert peak_flops_for(cpu, torch.float16) == 3e10  # the bf16 figure
    assert peak_flops_for(H100, torch.float64) == 67e12 / 2
    assert peak_flops_for(H100, torch.int64) == 67e12


def test_missing_link_kind_raises():
    with pytest.raises(ValueError, match="has no 'nvlink' link"):
        link_spec(get_hardware("cpu"), "nvlink")


# ---- compute -----------------------------------------------------------------------------------------------------

def test_mm_flops_and_compute_bound_time():
    info = op(aten.mm.default, (T(1024, 4096), T(4096, 4096)), (T(1024, 4096),))
    flops = 2 * 1024 * 4096 * 4096
    assert op_flops(info) == flops
    nbytes = (1024 * 4096 + 4096 * 4096 + 1024 * 4096) * 2
    assert op_bytes(info) == nbytes
    assert flops / 989e12 > nbytes / 3.35e12  # compute-bound
    assert compute_time(info, H100) == flops / 989e12


def test_addmm_bmm_baddbmm_and_matmul_flops():
    addmm = op(aten.addmm.default, (T(4096), T(1024, 4096), T(4096, 4096)), (T(1024, 4096),))
    assert op_flops(addmm) == 2 * 1024 * 4096 * 4096
    bmm = op(aten.bmm.default, (T(8, 64, 32), T(8, 32, 16)), (T(8, 64, 16),))
    assert op_flops(bmm) == 2 * 8 * 64 * 32 * 16
    baddbmm = op(aten.baddbmm.default, (T(8, 64, 16), T(8, 64, 32), T(8, 32, 16)), (T(8, 64, 16),))
    assert op_flops(baddbmm) == 2 * 8 * 64 * 32 * 16
    matmul = op(aten.matmul.default, (T(4, 5, 6), T(6, 7)), (T(4, 5, 7),))
    assert op_flops(matmul) == 2 * 4 * 5 * 6 * 7
    linear = op(aten.linear.default, (T(2, 3, 6), T(7, 6)), (T(2, 3, 7),))
    assert op_flops(linear) == 2 * 2 * 3 * 6 * 7


def test_convolution_flops_from_registry():
    x, w, out = T(8, 3, 32, 32, dtype=F32), T(16, 3, 3, 3, dtype=F32), T(8, 16, 30, 30, dtype=F32)
    info = op(aten.convolution.default, (x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1), (out,))
    assert op_flops(info) == 2 * 8 * 16 * 30 * 30 * (3 * 3 * 3)


def test_pointwise_is_bandwidth_bound_with_exact_bytes():
    x = T(4096, 4096)
    info = op(aten.add.Tensor, (x, x), (x,))
    numel = 4096 * 4096
    assert op_flops(info) == numel
    assert op_bytes(info) == 3 * numel * 2
    assert compute_time(info, H100) == 3 * numel * 2 / 3.35e12


def test_broadcast_pointwise_and_reduction_flops():
    bias_add = op(aten.add.Tensor, (T(128, 64), T(64)), (T(128, 64),))
    assert op_flops(bias_add) == 128 * 64
    assert op_bytes(bias_add) == (128 * 64 * 2 + 64) * 2
    reduction = op(aten.sum.dim_IntList, (T(1024, 4096), [1]), (T(1024),))
    assert op_flops(reduction) == 1024 * 4096


def test_view_ops_are_free():
    x = T(8, 16, 32)
    for info in (op(aten.view.default, (x, [128, 32]), (T(128, 32),)),
                 op(aten.transpose.int, (x, 0, 1), (T(16, 8, 32),)),
                 op(aten.t.default, (T(4, 5),), (T(5, 4),)),
                 op(aten.expand.default, (T(1, 32), [64, 32]), (T(64, 32),))):
        assert op_flops(info) == 0.0
        assert op_bytes(info) == 0.0
        assert compute_time(info, H100) == 0.0


def test_embedding_reads_only_gathered_rows():
    table, idx = T(50000, 1024), T(4, 128, dtype=torch.int64)
    info = op(aten.embedding.default, (table, idx), (T(4, 128, 1024),))
    out_bytes = 4 * 128 * 1024 * 2
    assert op_bytes(info) == out_bytes + out_bytes + 4 * 128 * 8


def test_pooling_norm_and_upsampling_are_memory_bound_with_the_bytes_their_kernels_move():
    x, half, vec = T(8, 64, 32, 32), T(8, 64, 16, 16), T(64, dtype=F32)
    idx = T(8, 64, 16, 16, dtype=torch.int64)
    # Max pooling backward reads grad_output and the argmax indices; the input only gives grad_input's shape.
    pool_bw = op(aten.max_pool2d_with_indices_backward.default, (half, x, [2, 2], [2, 2], [0, 0], [1, 1], False, idx),
                 (x,))
    assert op_bytes(pool_bw) == half.numel * 2 + idx.numel * 8 + x.numel * 2
    # Training batch norm reads its input twice (statistics, then normalization); eval mode once.
    train = op(aten._native_batch_norm_legit_functional.default, (x, vec, vec, vec, vec, True, 0.1, 1e-5),
               (x, vec, vec, vec, vec))
    assert op_bytes(train) == 3 * x.numel * 2 + 8 * 64 * 4
    evaluated = op(aten._native_batch_norm_legit_no_training.default, (x, vec, vec, vec, vec, 0.1, 1e-5),
                   (x, T(0, dtype=F32), T(0, dtype=F32)))
    assert op_bytes(evaluated) == 2 * x.numel * 2 + 4 * 64 * 4
    # A nearest upsampling lookup writes four times its input and reads the input once.
    rows, cols = T(64, 1, dtype=torch.int64), T(64, dtype=torch.int64)
    up = dataclasses.replace(op(aten._unsafe_index.Tensor, (x, [None, None, rows, cols]), (T(8, 64, 64, 64),)),
                             inputs=(x, rows, cols))
    assert op_bytes(up) == 4 * x.numel * 2 + x.numel * 2 + 128 * 8
    for info in (pool_bw, train, evaluated, up):
        assert compute_time(info, H100) == op_bytes(info) / H100.hbm_bandwidth

def _sdpa_forward(b, h, s, d, causal=False, target=aten._scaled_dot_product_flash_attention_for_cpu.default):
    q = T(b, h, s, d)
    return op(target, (q, q, q, 0.0, causal), (q, T(b, h, s, dtype=F32)))


def test_attention_flops_cpu_variant():
    b, h, s, d = 2, 16, 2048, 128
    assert op_flops(_sdpa_forward(b, h, s, d)) == 4 * b * h * s * s * d
    assert op_flops(_sdpa_forward(b, h, s, d, causal=True)) == 2 * b * h * s * s * d


def test_attention_flops_match_flop_counter_for_cuda_variants():
    shape = torch.Size((2, 16, 2048, 128))
    q = T(*shape)
    fwd = op(aten._scaled_dot_product_flash_attention.default, (q, q, q), (q,))
    assert op_flops(fwd) == flop_registry[aten._scaled_dot_product_flash_attention](shape, shape, shape)
    grad = op(aten._scaled_dot_product_efficient_attention_backward.default,
              (q, q, q, q, None, q, T(2, 16, 2048, dtype=F32), None, None, 0.0, [True, True, True, False], False),
              (q, q, q, None))
    expected = flop_registry[aten._scaled_dot_product_efficient_attention_backward](shape, shape, shape, shape)
    assert op_flops(grad) == expected == 2.5 * op_flops(fwd)


def test_attention_backward_cpu_variant_flops_and_bytes():
    b, h, s, d = 1, 8, 1024, 64
    q, lse = T(b, h, s, d), T(b, h, s, dtype=F32)
    info = op(aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
              (q, q, q, q, q, lse, 0.0, True), (q, q, q))
    assert op_flops(info) == 2.5 * 4 * b * h * s * s * d / 2
    qkv_bytes = b * h * s * d * 2
    assert op_bytes(info) == 8 * qkv_bytes  # grad_out, q, k, v, out read; dq, dk, dv written


def test_attention_fused_bytes_exclude_scores():
    b, h, s, d = 1, 16, 4096, 128
    info = _sdpa_forward(b, h, s, d)
    assert op_bytes(info) == 4 * b * h * s * d * 2  # q, k, v, out
    assert op_bytes(info) < b * h * s * s * 2  # less than one bf16 S x S score matrix
    flops = 4 * b * h * s * s * d
    assert compute_time(info, H100) == flops / 989e12


def test_compute_time_sharded_divides():
    info = op(aten.mm.default, (T(1024, 4096), T(4096, 4096)), (T(1024, 4096),))
    assert compute_time_sharded(info, H100, 4) == compute_time(info, H100) / 4
    with pytest.raises(ValueError):
        compute_time_sharded(info, H100, 0)


def test_fp8_scaled_mm_priced_at_fp8_rate_and_rejected_on_a100():
    a, b8 = T(1024, 4096, dtype=torch.float8_e4m3fn), T(4096, 4096, dtype=torch.float8_e4m3fn)
    scale = T(dtype=F32)
    info = op(aten._scaled_mm.default, (a, b8, scale, scale, None, None, BF16), (T(1024, 4096),))
    assert compute_time(info, H100) == 2 * 1024 * 4096 * 4096 / 1979e12
    with pytest.raises(ValueError, match="no FP8"):
        compute_time(info, get_hardware("a100"))


# ---- communication -----------------------------------------------------------------------------------------------

def test_all_reduce_ring_time():
    link = H100.links["nvlink"]
    expected = 2 * 7 / 8 * 1e9 / 450e9 + 2 * 7 * 1e-6
    assert collective_time("all_reduce", 1e9, 8, link) == pytest.approx(expected, rel=1e-12)


def test_all_gather_reduce_scatter_symmetry():
    link = H100.links["ib"]
    ag = collective_time("all_gather", 1e9, 16, link)
    rs = collective_time("reduce_scatter", 1e9, 16, link)
    assert ag == rs == pytest.approx(15 / 16 * 1e9 / 50e9 + 15 * 5e-6, rel=1e-12)
    assert collective_time("all_reduce", 1e9, 16, link) == pytest.approx(ag + rs, rel=1e-12)
    a2a = collective_time("all_to_all", 1e9, 16, link)
    assert a2a == pytest.approx(15 / 16 * 1e9 / 50e9 + 15 * 5e-6, rel=1e-12)


def test_single_rank_and_unknown_collective():
    link = H100.links["nvlink"]
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        assert collective_time(kind, 1e9, 1, link) == 0.0
    with pytest.raises(ValueError, match="unknown collective 'broadcast'"):
        collective_time("broadcast", 1e9, 8, link)


# ---- memory ------------------------------------------------------------------------------------------------------

def test_tensor_bytes():
    assert tensor_bytes((1024, 4096), BF16) == 1024 * 4096 * 2
    assert tensor_bytes((), F32) == 4


def test_param_state_bytes_gpu_default_is_16_per_element():
    assert param_state_bytes(1000, GPU_DEFAULT) == 16_000
    assert compute_copy_bytes(1000, GPU_DEFAULT) == 2_000


def test_param_state_bytes_cpu_default_and_bf16_master():
    assert param_state_bytes(1000, CPU_DEFAULT) == 16_000
    assert compute_copy_bytes(1000, CPU_DEFAULT) == 0
    bf16_params = TrainingPrecision(param_dtype=BF16, compute_dtype=BF16, grad_dtype=BF16, master_weights=True)
    assert param_state_bytes(1000, bf16_params) == (2 + 2 + 8 + 4) * 1000
    assert compute_copy_bytes(1000, bf16_params) == 0
