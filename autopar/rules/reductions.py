"""Reductions, softmax-like ops and losses: a Shard on a reduced dim becomes Partial, a kept dim stays Shard."""
from __future__ import annotations

import torch

from autopar.layout import P, P_AVG, R, S
from autopar.rules.base import AxisStrategy, OpInfo
from autopar.rules.common import arg, bcast, elementwise, norm_dim, partial_through
from autopar.rules.registry import register

aten = torch.ops.aten


def _reduced_dims(info: OpInfo, pos: int | None) -> set[int]:
    n = info.inputs[0].ndim
    dims = None if pos is None else arg(info, pos, "dim", None)
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return set(range(n))
    dims = [dims] if isinstance(dims, int) else dims
    return {norm_dim(d, n) for d in dims}


def reduction(info: OpInfo, partial, *, dims_pos: int | None = 1, keepdim_pos: int | None = 2,
              linear: bool = True) -> list[AxisStrategy]:
    """Shard on a kept dim maps to its output dim; on a reduced dim gives `partial` (None: not allowed).
    `dims_pos`/`keepdim_pos`: where the op takes its dims and keepdim arguments (None: full reduction).

    With `linear`, a Partial input passes through (sum and mean are linear).
    """
    n = info.inputs[0].ndim
    reduced = _reduced_dims(info, dims_pos)
    keepdim = bool(arg(info, keepdim_pos, "keepdim", False)) if keepdim_pos is not None else False
    res = []
    for d in range(n):
        if d in reduced:
            if partial is not None:
                res.append(AxisStrategy((S(d),), (partial,) * len(info.outputs)))
        else:
            j = d if keepdim else d - sum(1 for r in reduced if r < d)
            res.append(AxisStrategy((S(d),), (S(j),) * len(info.outputs)))
    return res + (partial_through(info, (0,)) if linear else [])


@register(aten.sum.dim_IntList)
def sum_dims(info: OpInfo):
    return reduction(info, P)


@register(aten.sum.default)
def sum_all(info: OpInfo):
    return reduction(info, P, dims_pos=None, keepdim_pos=None)


@register(aten.mean.dim)
def mean_dims(info: OpInfo):
    return reduction(info, P_AVG)


@register(aten.mean.default)
def mean_all(info: OpInfo):
    return reduction(info, P_AVG, dims_pos=None, keepdim_pos=None)


@register(aten.amax.default, aten.amin.default, aten.max.dim, aten.min.dim, aten.any.dim, aten.all.dim,
          aten.any.dims, aten.all.dims, aten.logsumexp.default, aten.argmax.default, aten.argmin.default)
def reduce_kept_only(info: OpInfo):
    # argmax/argmin without a dim flatten the input: nothing survives.
    if info.target in (aten.argmax.default, aten.argmin.default) and arg(info, 1, "dim") is None:
        return []
    return reduction(info, None, linear=False)


def _along(info: OpInfo, dim: int, n_in: int) -> list[AxisStrategy]:
    n = info.inputs[0].ndim
    dim = norm_dim(dim, n)
    return [AxisStrategy((S(d),) * n_in, (S(d),)) for d in range(n) if d != dim]


@register(aten._softmax.default, aten._log_softmax.default, aten._safe_softmax.default)
def softmax(info: OpInfo):
    return _along(info, info.args[1], 1)


@register(aten._softmax_backward_data.default, aten._log_softmax_backward_data.default)
def softmax_backward(info: OpInfo):
    # Both backward formulas are linear in grad_output for a fixed forward output.
    return _along(info, info.args[2], 2) + partial_through(info, (0,))


@register(aten.cumsum.default)
def cumsum(info: OpInfo):
    # A running sum is linear.
    return _along(info, info.args[1], 1) + partial_through(info, (0,))


@register(aten.mse_loss.default)
def mse_loss(info: OpInfo):
    reduction_ = arg(info, 2, "reduction", 1)
    if reduction_ == 0:
        return elementwise(info)
    out_p = P_AVG if reduction_ == 1 else P
    x = info.inputs[0]
    return [AxisStrategy(tuple(bcast(m, d, x.ndim) for m in info.inputs), (out_p,)) for d in range(x.ndim)]


@register(aten.mse_loss_backward.default)
def mse_loss_backward(info: OpInfo):
    reduction_ = arg(info, 3, "reduction", 1)
    # Linear in grad_output; and linear in (input, target) jointly, as it is 2 * (input - target) * grad / N.
    extra = partial_through(info, (0,)) + partial_through(info, (1, 2))
    if reduction_ == 0:
        return elementwise(info) + extra
    if reduction_ == 2:
        n = info.outputs[0].ndim
        return [AxisStrategy((R,) + tuple(bcast(m, d, n) for m in info.inputs[1:]), (S(d),))
                for d in range(n)] + extra
    # Mean: each rank would divide by its local count, not the global one.
    return extra
