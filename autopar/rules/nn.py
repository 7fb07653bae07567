"""Neural-network layers with their own kernels: embedding, layer/RMS norm and dropout, forward and backward
(convolution: conv.py; batch/group/weight norm: norms.py; pooling and upsampling: pooling.py)."""
from __future__ import annotations

import torch

from autopar.layout import P, R, S
from autopar.rules.base import AxisStrategy, OpInfo
from autopar.rules.common import PARTIALS, arg, elementwise, partial_through
from autopar.rules.registry import register

aten = torch.ops.aten


@register(aten.embedding.default)
def embedding(info: OpInfo):
    weight, idx = info.inputs
    res = [AxisStrategy((R, S(d)), (S(d),)) for d in range(idx.ndim)]
    res.append(AxisStrategy((S(1), R), (S(idx.ndim),)))
    # A lookup is linear in the table.
    return res + partial_through(info, (0,))


@register(aten.embedding_dense_backward.default)
def embedding_dense_backward(info: OpInfo):
    grad, idx = info.inputs
    res = []
    if not arg(info, 4, "scale_grad_by_freq", False):  # frequencies would be counted per rank
        res += [AxisStrategy((S(d), S(d)), (P,)) for d in range(idx.ndim)]
    res.append(AxisStrategy((S(grad.ndim - 1), R), (S(1),)))
    # The scatter-add of gradient rows is linear in grad_output.
    return res + partial_through(info, (0,))


def _leading(info: OpInfo, x_index: int, norm_ndim: int) -> int:
    return info.inputs[x_index].ndim - norm_ndim


@register(aten.native_layer_norm.default)
def native_layer_norm(info: OpInfo):
    lead = _leading(info, 0, len(info.args[1]))
    params = (R,) * (len(info.inputs) - 1)
    return [AxisStrategy((S(d),) + params, (S(d),) * 3) for d in range(lead)]


@register(aten.native_layer_norm_backward.default)
def native_layer_norm_backward(info: OpInfo):
    # inputs: grad_out, input, mean, rstd, [weight], [bias]; outputs: grad_input, grad_weight, grad_bias
    lead = _leading(info, 0, len(info.args[2]))
    params = (R,) * (len(info.inputs) - 4)
    res = [AxisStrategy((S(d),) * 4 + params, (S(d), P, P)) for d in range(lead)]
    # All three gradients are linear in grad_output for fixed input statistics.
    return res + partial_through(info, (0,))


@register(aten._fused_rms_norm.default)
def fused_rms_norm(info: OpInfo):
    lead = _leading(info, 0, len(info.args[1]))
    params = (R,) * (len(info.inputs) - 1)
    return [AxisStrategy((S(d),) + params, (S(d), S(d))) for d in range(lead)]


@register(aten._fused_rms_norm_backward.default)
def fused_rms_norm_backward(info: OpInfo):
    # inputs: grad_out, input, rstd, [weight]; outputs: grad_input, grad_weight
    lead = _leading(info, 0, len(info.args[2]))
    params = (R,) * (len(info.inputs) - 3)
    res = [AxisStrategy((S(d),) * 3 + params, (S(d), P)) for d in range(lead)]
    # Both gradients are linear in grad_output.
    return res + partial_through(info, (0,))


@register(aten.native_dropout.default)
def native_dropout(info: OpInfo):
    # outputs: (input * mask * scale, mask). Each rank draws the mask of the piece it holds (codegen/rng.py):
    # any dim shards, the mask alike.
    res = elementwise(info)
    # Ranks that differ only on a Partial axis draw the same mask (their shard of the input is the same), and
    # for a fixed mask dropout is linear in its input: the masked parts sum to the masked value.
    return res + [AxisStrategy((p,), (p, R)) for p in PARTIALS]
