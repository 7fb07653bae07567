"""Batch, group and weight norm, forward and backward: shard only dims the statistics are not taken over.

Batch norm in training takes per-channel statistics over the batch and every spatial dim, so only channels
shard (each rank's channels have all their samples). A batch-sharded input would need the statistics of the
whole global batch (what SyncBatchNorm computes with two all-reduces inside the op); one op's strategy cannot
express a collective inside the op, so that layout is not offered here: the rule never claims that local
statistics are the model's. Running statistics follow the channels, so they stay exact. In eval mode batch norm
is a per-channel affine map of the running statistics: any dim shards.

Group norm takes statistics per (sample, group): the batch shards, and channels shard in whole groups (its
mean and rstd outputs, shaped (N, groups), carry the evenness check). Weight norm takes the norm over every dim
but `dim`, which alone shards.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.distributed.tensor import Placement

from autopar.layout import P, R, S
from autopar.rules.base import AxisStrategy, OpInfo, TensorMeta
from autopar.rules.common import arg, partial_through
from autopar.rules.registry import register

aten = torch.ops.aten


def by_position(info: OpInfo, place: Callable[[int], Placement]) -> tuple[Placement, ...]:
    """One placement per tensor argument, from its position in the op's schema (optional tensors may be None
    and then take no entry)."""
    names = [a.name for a in info.target._schema.arguments]
    pos = [i for i, a in enumerate(info.args) if isinstance(a, TensorMeta)]
    pos += [names.index(k) for k, v in info.kwargs.items() if isinstance(v, TensorMeta)]
    return tuple(place(i) for i in pos)


def _channel_vectors(info: OpInfo, channel_args: dict[int, Placement]) -> Callable[[int], Placement]:
    """Placement by argument position: `channel_args` for the activations, S(0) for per-channel vectors and R
    for anything else (the empty statistics eval mode returns)."""
    c = info.inputs[0].shape[1]

    def place(i: int) -> Placement:
        if i in channel_args:
            return channel_args[i]
        meta = info.args[i] if i < len(info.args) else None
        return S(0) if isinstance(meta, TensorMeta) and meta.shape == (c,) else R
    return place


def _vector_outs(info: OpInfo, first: Placement) -> tuple[Placement, ...]:
    c = info.inputs[0].shape[1]
    return (first,) + tuple(S(0) if m is not None and m.shape == (c,) else R for m in info.outputs[1:])


@register(aten._native_batch_norm_legit_functional.default, aten._native_batch_norm_legit.no_stats)
def batch_norm_training(info: OpInfo):
    # inputs: input, weight?, bias?, [running_mean, running_var]; outputs: out, save_mean, save_rstd,
    # [new running_mean, new running_var]. no_stats computes batch statistics too (track_running_stats=False).
    if info.inputs[0].ndim < 2:
        return []
    return [AxisStrategy(by_position(info, _channel_vectors(info, {0: S(1)})), _vector_outs(info, S(1)))]


@register(aten._native_batch_norm_legit_no_training.default)
def batch_norm_eval(info: OpInfo):
    # inputs: input, weight?, bias?, running_mean, running_var; outputs: out and two empty statistics.
    x = info.inputs[0]
    res = batch_norm_training(info)
    for d in range(x.ndim):
        if d != 1:
            res.append(AxisStrategy(by_position(info, lambda i, d=d: S(d) if i == 0 else R),
                                    (S(d),) + (R,) * (len(info.outputs) - 1)))
    return res


@register(aten.native_batch_norm_backward.default)
def batch_norm_backward(info: OpInfo):
    # args: grad_out, input, weight?, running_mean?, running_var?, save_mean?, save_invstd?, train, eps, mask;
    # outputs: grad_input, grad_weight, grad_bias
    x = info.inputs[1]
    if x.ndim < 2:
        return []
    act = {0: S(1), 1: S(1)}
    res = [AxisStrategy(by_position(info, _channel_vectors(info, act)), (S(1), S(0), S(0)))]
    if not arg(info, 7, "train"):
        # Eval mode normalizes with the running statistics: samples and positions are independent, and the
        # parameter gradients sum over them.
        for d in range(x.ndim):
            if d != 1:
                res.append(AxisStrategy(by_position(info, lambda i, d=d: S(d) if i in (0, 1) else R), (S(d), P, P)))
    # For fixed input and statistics, all three gradients are linear in grad_out.
    return res + partial_through(info, (0,))


@register(aten.native_group_norm.default)
def group_norm(info: OpInfo):
    # args: input, weight?, bias?, N, C, HxW, group, eps; outputs: out (N, C, *), mean (N, G), rstd (N, G)
    batch = AxisStrategy(by_position(info, lambda i: S(0) if i == 0 else R), (S(0),) * 3)
    groups = AxisStrategy(by_position(info, lambda i: S(1) if i == 0 else S(0)), (S(1),) * 3)
    return [batch, groups]


@register(aten.native_group_norm_backward.default)
def group_norm_backward(info: OpInfo):
    # args: grad_out, input, mean, rstd, weight?, N, C, HxW, group, mask; outputs: grad_input, grad_weight, grad_bias
    batch = AxisStrategy(by_position(info, lambda i: S(0) if i < 4 else R), (S(0), P, P))
    groups = AxisStrategy(by_position(info, lambda i: S(1) if i < 4 else S(0)), (S(1), S(0), S(0)))
    # For fixed input and statistics, all three gradients are linear in grad_out.
    return [batch, groups] + partial_through(info, (0,))


def group_norm_sizes(info: OpInfo, local_input_shape) -> dict[int, int]:
    """The (N, C, group) arguments for a rank holding `local_input_shape` of the input: {position: value}."""
    bw = info.target is aten.native_group_norm_backward.default
    n_pos = 5 if bw else 3
    x = info.inputs[1 if bw else 0]
    n, c = int(local_input_shape[0]), int(local_input_shape[1])
    groups = info.args[n_pos + 3]
    assert (groups * c) % x.shape[1] == 0, (info.name, groups, x.shape, local_input_shape)
    return {n_pos: n, n_pos + 1: c, n_pos + 3: groups * c // x.shape[1]}


def _norm_dim(v: TensorMeta, g: TensorMeta, dim: int) -> int | None:
    """The dim weight norm keeps (norms are taken over all others), or None when the norm is over everything."""
    if not 0 <= dim < v.ndim or g.ndim != v.ndim or g.shape[dim] != v.shape[dim]:
        return None
    return dim


@register(aten._weight_norm_interface.default)
def weight_norm(info: OpInfo):
    # inputs: v, g; outputs: w = g * v / |v|, the norms
    d = _norm_dim(info.inputs[0], info.inputs[1], arg(info, 2, "dim", 0))
    return [] if d is None else [AxisStrategy((S(d), S(d)), (S(d), S(d)))]


@register(aten._weight_norm_interface_backward.default)
def weight_norm_backward(info: OpInfo):
    # inputs: grad_w, v, g, norms; outputs: grad_v, grad_g
    d = _norm_dim(info.inputs[1], info.inputs[2], info.args[4])
    res = [] if d is None else [AxisStrategy((S(d),) * 4, (S(d), S(d)))]
    # For fixed v and g, both gradients are linear in grad_w.
    return res + partial_through(info, (0,))
