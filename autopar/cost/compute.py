"""Roofline time of one op on one device: FLOPs against peak compute, bytes moved against memory bandwidth."""
from __future__ import annotations

import math
import operator
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

from autopar.cost.hardware import HardwareSpec, peak_flops_for
from autopar.rules.base import OpInfo, TensorMeta

aten = torch.ops.aten

# Ops that only reinterpret metadata: no kernel runs, so they move no bytes and take no time. reshape is listed
# because traced activations are contiguous, where it is a view.
VIEW_OPS = frozenset({
    aten.view, aten._unsafe_view, aten.reshape, aten._reshape_alias, aten.view_as, aten.t, aten.transpose,
    aten.permute, aten.expand, aten.expand_as, aten.unsqueeze, aten.squeeze, aten.slice, aten.split,
    aten.split_with_sizes, aten.unbind, aten.chunk, aten.narrow, aten.select, aten.detach, aten.alias,
    aten.as_strided, aten.flatten, aten.unflatten, aten.movedim, aten.lift_fresh, operator.getitem,
})

_SDPA_FORWARD = frozenset({
    aten.scaled_dot_product_attention, aten._scaled_dot_product_attention_math,
    aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_flash_attention_for_cpu,
    aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_cudnn_attention,
    aten._scaled_dot_product_fused_attention_overrideable,
})
_SDPA_BACKWARD = frozenset({
    aten._scaled_dot_product_flash_attention_backward, aten._scaled_dot_product_flash_attention_for_cpu_backward,
    aten._scaled_dot_product_efficient_attention_backward, aten._scaled_dot_product_cudnn_attention_backward,
    aten._scaled_dot_product_fused_attention_overrideable_backward,
})
# Tensors a fused attention kernel really streams through memory; logsumexp, RNG state and offsets are small.
_SDPA_READS = frozenset({"query", "key", "value", "out", "grad_out", "grad_out_", "attn_mask", "attn_bias"})

# Ops that read only the rows they return from their first argument (an embedding table, say), not all of it;
# when they return more than the table (an upsampling lookup), the repeats come from cache: the table once.
_GATHER_OPS = frozenset({aten.embedding, aten.index_select, aten.gather, aten.index, aten._unsafe_index})

# Backward kernels that take an input only for its shape (argument index among the tensor inputs): they read
# grad_output (and the argmax indices) and write grad_input.
_SHAPE_ONLY_INPUT = {op: 1 for op in (
    aten.max_pool2d_with_indices_backward, aten.max_pool3d_with_indices_backward, aten.adaptive_max_pool2d_backward,
    aten.adaptive_max_pool3d_backward, aten.avg_pool2d_backward, aten.avg_pool3d_backward,
    aten._adaptive_avg_pool2d_backward, aten._adaptive_avg_pool3d_backward)}

# Norms whose statistics span more than a cache holds (batch norm's per-channel statistics cover the whole batch,
# group norm's a whole group of channels) read their activations twice: once for the statistics (or, backward,
# the two gradient sums), once for the elementwise pass. Value: tensor inputs read twice. Layer and RMS norm
# rows fit on chip and are read once; eval-mode batch norm has no statistics pass.
_TWO_PASS = {
    aten._native_batch_norm_legit_functional.default: (0,), aten._native_batch_norm_legit.no_stats: (0,),
    aten.native_group_norm.default: (0,), aten.native_group_norm_backward.default: (0, 1),
}


def _packet(target: Any) -> Any:
    return getattr(target, "overloadpacket", target)


def _nbytes(t: TensorMeta | None) -> int:
    return 0 if t is None else t.numel * t.dtype.itemsize


def _named_args(info: OpInfo) -> dict[str, Any]:
    """The op's arguments by schema name, positional and keyword alike."""
    schema = getattr(info.target, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    return {**dict(zip(names, info.args)), **info.kwargs}


def _shapes(x: Any, raw: bool) -> Any:
    """Tensor metadata as the registry's formulas expect tensors: shapes, or objects with .shape for raw ones."""
    if isinstance(x, TensorMeta):
        return x if raw else torch.Size(x.shape)
    if isinstance(x, (list, tuple)):
        return type(x)(_shapes(v, raw) for v in x)
    return x


def _sdpa_flops(info: OpInfo, backward: bool) -> float:
    """Attention FLOPs from q, k, v shapes (B, H, S, D): two matmuls forward, five backward (one recomputes the
    scores), halved when causal. Matches flop_counter's formulas where it has them, for every kernel variant."""
    a = _named_args(info)
    b, h_q, s_q, d_qk = a["query"].shape
    s_k, d_v = a["key"].shape[-2], a["value"].shape[-1]
    per_score = 2 * (3 * d_qk + 2 * d_v) if backward else 2 * (d_qk + d_v)
    flops = b * h_q * s_q * s_k * per_score
    return flops / 2 if a.get("is_causal", False) else flops


def _matmul_flops(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """torch.matmul semantics: 1-D operands are promoted, leading dims broadcast."""
    a = (1, *a) if len(a) == 1 else tuple(a)
    b = (*b, 1) if len(b) == 1 else tuple(b)
    batch = torch.broadcast_shapes(a[:-2], b[:-2])
    return 2 * math.prod(batch) * a[-2] * a[-1] * b[-1]


def _other_matmul_flops(packet: Any, ins: tuple[TensorMeta, ...]) -> int | None:
    """Matmul-family ops the registry lacks (they appear in graphs captured before decomposition)."""
    if packet in (aten.matmul, aten.mv, aten.dot):
        return _matmul_flops(ins[0].shape, ins[1].shape)
    if packet == aten.linear:
        return 2 * ins[0].numel * ins[1].shape[0]
    if packet == aten.addmv:
        return _matmul_flops(ins[1].shape, ins[2].shape)
    if packet == aten.addbmm:
        return _matmul_flops(ins[1].shape, ins[2].shape)
    return None


def _elementwise_flops(info: OpInfo) -> int:
    """One FLOP per element of the larger side: the output for pointwise ops, the input for reductions."""
    out = sum(t.numel for t in info.outputs if t is not None)
    if _packet(info.target) in _GATHER_OPS:
        return out
    return max([out, *(t.numel for t in info.inputs)])


def op_flops(info: OpInfo) -> float:
    """FLOPs of one op at the shapes in `info` (global or per-device alike)."""
    packet = _packet(info.target)
    if packet in VIEW_OPS:
        return 0.0
    if packet in _SDPA_FORWARD or packet in _SDPA_BACKWARD:
        return float(_sdpa_flops(info, backward=packet in _SDPA_BACKWARD))
    formula = flop_registry.get(packet)
    if formula is not None:
        # Wrapped formulas take shapes plus `out_val` (mapped to out_shape); raw ones read `.shape` themselves.
        raw = not hasattr(formula, "__wrapped__")
        outs = [_shapes(t, raw) for t in info.outputs]
        out_val = outs[0] if len(outs) == 1 else tuple(outs)
        return float(formula(*_shapes(info.args, raw), **_shapes(info.kwargs, raw), out_val=out_val))
    matmul = _other_matmul_flops(packet, info.inputs)
    return float(matmul if matmul is not None else _elementwise_flops(info))


def _sdpa_bytes(info: OpInfo, backward: bool) -> int:
    """Fused attention streams q, k, v, out (and their grads backward); the S x S scores never reach memory."""
    reads = sum(_nbytes(v) for k, v in _named_args(info).items() if k in _SDPA_READS and isinstance(v, TensorMeta))
    writes = info.outputs[:3] if backward else info.outputs[:1]
    return reads + sum(_nbytes(t) for t in writes)


def op_bytes(info: OpInfo) -> float:
    """Bytes one op reads plus writes: every tensor input and output once, views nothing."""
    packet = _packet(info.target)
    if packet in VIEW_OPS:
        return 0.0
    if packet in _SDPA_FORWARD or packet in _SDPA_BACKWARD:
        return float(_sdpa_bytes(info, backward=packet in _SDPA_BACKWARD))
    written = sum(_nbytes(t) for t in info.outputs)
    if packet in _GATHER_OPS and info.inputs:
        table, rest = info.inputs[0], info.inputs[1:]
        out_numel = sum(t.numel for t in info.outputs if t is not None)
        return float(written + min(out_numel, table.numel) * table.dtype.itemsize + sum(_nbytes(t) for t in rest))
    read = [_nbytes(t) for t in info.inputs]
    if packet in _SHAPE_ONLY_INPUT and len(read) > _SHAPE_ONLY_INPUT[packet]:
        read[_SHAPE_ONLY_INPUT[packet]] = 0
    for i in _reread(info):
        read[i] *= 2
    return float(written + sum(read))


def _reread(info: OpInfo) -> tuple[int, ...]:
    if info.target is aten.native_batch_norm_backward.default:
        train = _named_args(info).get("train")
        return (0, 1) if train else ()
    return _TWO_PASS.get(info.target, ())


def _math_dtype(info: OpInfo) -> torch.dtype:
    """The dtype the math runs in: the first floating input (an FP8 _scaled_mm runs at the FP8 rate even though
    it writes bf16), else the first floating output, else float32."""
    for t in (*info.inputs, *info.outputs):
        if t is not None and t.dtype.is_floating_point:
            return t.dtype
    return torch.float32


def compute_time(info: OpInfo, hw: HardwareSpec) -> float:
    """Seconds for one op on one device: the roofline max(FLOPs / peak, bytes / bandwidth).

    Peak is the dense datasheet figure with no efficiency derating (factor 1.0, matmuls included): the planner
    compares layouts, and a common factor would not change which one wins.
    """
    if _packet(info.target) in VIEW_OPS:
        return 0.0
    flops = op_flops(info)
    flop_time = flops / peak_flops_for(hw, _math_dtype(info)) if flops else 0.0
    return max(flop_time, op_bytes(info) / hw.hbm_bandwidth)


def compute_time_sharded(info: OpInfo, hw: HardwareSpec, split: int) -> float:
    """Seconds for one device's share when the op at global shapes in `info` is split evenly `split` ways.

    Both FLOPs and bytes divide by `split`, so the roofline time does too; smaller per-device kernels running
    below peak are not modelled.
    """
    if split < 1:
        raise ValueError(f"split must be a positive number of ways, got {split}")
    return compute_time(info, hw) / split


__all__ = ["VIEW_OPS", "op_flops", "op_bytes", "compute_time", "compute_time_sharded"]
