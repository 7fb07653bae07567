"""Convolution, forward and backward: shard the batch, the output channels, or the contracted input channels.

Tensors: input (N, C_in, *spatial); weight (C_out, C_in/g, *k), or (C_in, C_out/g, *k) when transposed; output
(N, C_out, *spatial). Spatial dims are never sharded: a sliding window would need halos from the neighbours.
Stride, padding, dilation and output padding act on spatial dims only, so every layout here holds for any of them.

Grouped convolutions (groups g > 1) shard channels in whole groups, with the groups argument divided by the
shard count (`local_groups`). That is exact only when the shard count divides g; the planner checks evenness
against tensor dims only, so the channel layout is offered just for g == C_in or g == C_out (depthwise and
channel-multiplier convolutions), where an even split of those channels is an even split of the groups.
"""
from __future__ import annotations

import torch

from autopar.layout import P, R, S
from autopar.rules.base import AxisStrategy, OpInfo
from autopar.rules.common import partial_through
from autopar.rules.registry import register

aten = torch.ops.aten


def _groups_shardable(c_in: int, c_out: int, groups: int) -> bool:
    return groups > 1 and groups in (c_in, c_out)


@register(aten.convolution.default)
def convolution(info: OpInfo):
    # args: input, weight, bias, stride, padding, dilation, transposed, output_padding, groups
    x, out = info.inputs[0], info.outputs[0]
    transposed, groups = info.args[6], info.args[8]
    bias = (lambda p: (p,)) if len(info.inputs) == 3 else (lambda p: ())
    res = [AxisStrategy((S(0), R) + bias(R), (S(0),))]
    w_out, w_in = (1, 0) if transposed else (0, 1)  # weight dims of the output and input channels
    if groups == 1:
        res.append(AxisStrategy((R, S(w_out)) + bias(S(0)), (S(1),)))  # output channels
        # Input channels are contracted: each rank sums over its channels; the bias is added once in total.
        res.append(AxisStrategy((S(1), S(w_in)) + bias(P), (P,)))
    elif _groups_shardable(x.shape[1], out.shape[1], groups):
        res.append(AxisStrategy((S(1), S(0)) + bias(S(0)), (S(1),)))  # whole groups: weight dim 0 is group-major
    return res


@register(aten.convolution_backward.default)
def convolution_backward(info: OpInfo):
    # args: grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups,
    # output_mask; outputs: grad_input, grad_weight, grad_bias
    g, x = info.inputs[0], info.inputs[1]
    transposed, groups = info.args[7], info.args[9]
    res = [AxisStrategy((S(0), S(0), R), (S(0), P, P))]  # the weight and bias gradients sum over the batch
    w_out, w_in = (1, 0) if transposed else (0, 1)
    if groups == 1:
        res.append(AxisStrategy((S(1), R, S(w_out)), (P, S(w_out), S(0))))  # output channels
        res.append(AxisStrategy((R, S(1), S(w_in)), (S(1), S(w_in), R)))  # input channels
    elif _groups_shardable(x.shape[1], g.shape[1], groups):
        res.append(AxisStrategy((S(1), S(1), S(0)), (S(1), S(0), S(0))))
    # All three gradients are linear in grad_output.
    return res + partial_through(info, (0,))


def local_groups(info: OpInfo, local_in_channels: int) -> int:
    """The groups argument for a rank holding `local_in_channels` of the input's channels: whole groups only."""
    groups_pos, x_index = (8, 0) if info.target is aten.convolution.default else (9, 1)
    groups, c_in = info.args[groups_pos], info.inputs[x_index].shape[1]
    if groups == 1 or local_in_channels == c_in:
        return groups
    assert (groups * local_in_channels) % c_in == 0, (info.name, groups, c_in, local_in_channels)
    return groups * local_in_channels // c_in
