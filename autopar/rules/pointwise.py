"""Elementwise ops as tables grouped by algebraic property: which dims shard (all, with broadcasting) and which
inputs may carry a Partial that passes to the output."""
from __future__ import annotations

from typing import Callable

import torch

from autopar.rules.base import AxisStrategy, OpInfo, TensorMeta
from autopar.rules.common import each_partial, elementwise, partial_through
from autopar.rules.registry import register

aten = torch.ops.aten

# Nonlinear elementwise ops (whole packets): shard any dim, no Partial rule.
NONLINEAR = [
    aten.abs, aten.atan2, aten.bitwise_and, aten.bitwise_not, aten.bitwise_or, aten.bitwise_xor, aten.ceil,
    aten.clamp, aten.clamp_max, aten.clamp_min, aten.cos, aten.elu, aten.eq, aten.erf, aten.exp, aten.expm1,
    aten.floor, aten.fmod, aten.ge, aten.gelu, aten.gt, aten.hardtanh, aten.isinf, aten.isnan, aten.le,
    aten.leaky_relu, aten.log, aten.log1p, aten.log2, aten.logical_and, aten.logical_not, aten.logical_or,
    aten.logical_xor, aten.lt, aten.maximum, aten.minimum, aten.ne, aten.pow, aten.reciprocal, aten.relu,
    aten.remainder, aten.round, aten.rsqrt, aten.sigmoid, aten.sign, aten.silu, aten.sin, aten.softplus,
    aten.sqrt, aten.tanh, aten.trunc, aten.masked_fill, aten.add, aten.sub, aten.mul, aten.div, aten.rsub,
    aten.where.ScalarOther, aten.where.ScalarSelf, aten.clone, aten.copy,
]


def _tensor_operands(info: OpInfo, k: int) -> bool:
    return len(info.args) >= k and all(isinstance(a, TensorMeta) for a in info.args[:k])


def _all_if_tensors(k: int) -> Callable[[OpInfo], list[AxisStrategy]]:
    """Partial on every operand jointly, only when the first k operands are all tensors (a scalar operand would
    make the op affine, not linear)."""
    return lambda info: partial_through(info, range(len(info.inputs))) if _tensor_operands(info, k) else []


def _first(info: OpInfo) -> list[AxisStrategy]:
    return partial_through(info, (0,))


def _each(info: OpInfo) -> list[AxisStrategy]:
    return each_partial(info, range(len(info.inputs)))


def _only(*idx: int) -> Callable[[OpInfo], list[AxisStrategy]]:
    return lambda info: partial_through(info, idx)


def _cast(info: OpInfo) -> list[AxisStrategy]:
    src, dst = info.inputs[0].dtype, info.outputs[0].dtype
    ok = torch.bool not in (src, dst) and (dst.is_floating_point or not src.is_floating_point)
    return _first(info) if ok else []


def _masked_fill_zero(info: OpInfo) -> list[AxisStrategy]:
    return _first(info) if info.args[2] == 0 else []


# Overloads with Partial rules: op -> (which inputs may be Partial, why the output is then Partial).
PARTIAL_RULES: dict[object, tuple[Callable[[OpInfo], list[AxisStrategy]], str]] = {
    aten.add.Tensor: (_all_if_tensors(2), "a sum of Partial operands is the Partial of the sum"),
    aten.sub.Tensor: (_all_if_tensors(2), "a difference of Partial operands is the Partial of the difference"),
    aten.mul.Tensor: (_each, "a product is linear in each factor (a scalar factor only scales)"),
    aten.div.Tensor: (_first, "division by a replicated divisor or a scalar is linear in the dividend"),
    aten.mul.Scalar: (_first, "multiplying by a scalar is linear"),
    aten.div.Scalar: (_first, "dividing by a scalar is linear"),
    aten.neg.default: (_first, "negation is linear"),
    aten.clone.default: (_first, "a copy is linear"),
    aten.where.self: (_only(1, 2), "selecting between Partial branches by a replicated mask selects their parts"),
    aten.copy.default: (_only(1), "the result is the source, broadcast to the destination"),
    aten.masked_fill.Scalar: (_masked_fill_zero, "filling with zero keeps the parts summing to the result"),
    aten._to_copy.default: (_cast, "a cast into a floating (or int to int) dtype commutes with summing the parts"),
    aten.threshold_backward.default: (_first, "linear in grad_output (the mask comes from the replicated input)"),
    aten.silu_backward.default: (_first, "linear in grad_output"),
    aten.gelu_backward.default: (_first, "linear in grad_output"),
    aten.tanh_backward.default: (_first, "linear in grad_output"),
    aten.sigmoid_backward.default: (_first, "linear in grad_output"),
    aten.hardtanh_backward.default: (_first, "linear in grad_output"),
    aten.leaky_relu_backward.default: (_first, "linear in grad_output"),
    aten.native_dropout_backward.default: (_first, "linear in grad_output (the mask replicates)"),
}


def _pointwise(info: OpInfo) -> list[AxisStrategy]:
    return elementwise(info)


def _pointwise_with_partial(extra: Callable[[OpInfo], list[AxisStrategy]]):
    def rule(info: OpInfo) -> list[AxisStrategy]:
        return elementwise(info) + extra(info)
    return rule


register(*NONLINEAR)(_pointwise)
for _op, (_extra, _why) in PARTIAL_RULES.items():
    register(_op)(_pointwise_with_partial(_extra))
