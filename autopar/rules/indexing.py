"""Indexing, slicing and joining ops: shard every dim the op does not index, slice or concatenate along."""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch.distributed.tensor import Placement

from autopar.layout import P, R, S
from autopar.rules.base import AxisStrategy, OpInfo
from autopar.rules.common import arg, bcast, dim_map, norm_dim, partial_through
from autopar.rules.registry import register

aten = torch.ops.aten


def _free(info: OpInfo, dim: int, place: Callable[[int], Sequence[Placement]], out_dim: Callable[[int], int],
          ndim: int) -> list[AxisStrategy]:
    """For each dim d != `dim` of an ndim-dim tensor: inputs placed by place(d), every output S(out_dim(d))."""
    return [AxisStrategy(tuple(place(d)), (S(out_dim(d)),) * len(info.outputs)) for d in range(ndim) if d != dim]


def _full_range(size: int, start, end, step) -> bool:
    start = 0 if start is None else start
    end = size if end is None else end
    return start in (0, -size) and (end >= size) and step in (None, 1)


@register(aten.slice.Tensor)
def slice_(info: OpInfo):
    x = info.inputs[0]
    dim = norm_dim(arg(info, 1, "dim", 0), x.ndim)
    keep = _full_range(x.shape[dim], arg(info, 2, "start"), arg(info, 3, "end"), arg(info, 4, "step", 1))
    return dim_map(info, {d: d for d in range(x.ndim) if d != dim or keep})


@register(aten.slice_backward.default)
def slice_backward(info: OpInfo):
    n = info.outputs[0].ndim
    dim = norm_dim(info.args[2], n)
    return dim_map(info, {d: d for d in range(n) if d != dim})


@register(aten.select.int)
def select(info: OpInfo):
    n = info.inputs[0].ndim
    dim = norm_dim(info.args[1], n)
    return dim_map(info, {d: d if d < dim else d - 1 for d in range(n) if d != dim})


@register(aten.select_backward.default)
def select_backward(info: OpInfo):
    n = info.outputs[0].ndim
    dim = norm_dim(info.args[2], n)
    return dim_map(info, {d if d < dim else d - 1: d for d in range(n) if d != dim})


@register(aten.slice_scatter.default)
def slice_scatter(info: OpInfo):
    n = info.inputs[0].ndim
    dim = norm_dim(arg(info, 2, "dim", 0), n)
    return _free(info, dim, lambda d: (S(d), S(d)), lambda d: d, n) + partial_through(info, (0, 1))


@register(aten.select_scatter.default)
def select_scatter(info: OpInfo):
    n = info.inputs[0].ndim
    dim = norm_dim(info.args[2], n)
    return (_free(info, dim, lambda d: (S(d), S(d if d < dim else d - 1)), lambda d: d, n)
            + partial_through(info, (0, 1)))


@register(aten.split.Tensor, aten.split_with_sizes.default)
def split(info: OpInfo):
    n = info.inputs[0].ndim
    dim = norm_dim(arg(info, 2, "dim", 0), n)
    return dim_map(info, {d: d for d in range(n) if d != dim})


@register(aten.cat.default)
def cat(info: OpInfo):
    n = info.outputs[0].ndim
    dim = norm_dim(arg(info, 1, "dim", 0), n)
    # Legacy cat skips 1-D empty inputs; they stay replicated.
    place = lambda d: tuple(S(d) if m.ndim == n else R for m in info.inputs)  # noqa: E731
    return _free(info, dim, place, lambda d: d, n) + partial_through(info, range(len(info.inputs)))


@register(aten.stack.default)
def stack(info: OpInfo):
    n = info.inputs[0].ndim
    dim = norm_dim(arg(info, 1, "dim", 0), n + 1)
    place = lambda d: (S(d),) * len(info.inputs)  # noqa: E731
    return (_free(info, -1, place, lambda d: d if d < dim else d + 1, n)
            + partial_through(info, range(len(info.inputs))))


def _aligned(info: OpInfo, dim: int) -> list[int]:
    """Dims other than `dim` where every tensor argument has the same size (so their row blocks line up)."""
    n = info.inputs[0].ndim
    return [d for d in range(n) if d != dim and len({m.shape[d] for m in info.inputs if m.ndim == n}) == 1]


@register(aten.gather.default)
def gather(info: OpInfo):
    dim = norm_dim(info.args[1], info.inputs[0].ndim)
    res = [AxisStrategy((S(d), S(d)), (S(d),)) for d in _aligned(info, dim)]
    # Gathering picks entries of the input: linear in the input for a fixed index.
    return res + partial_through(info, (0,))


@register(aten.scatter.value, aten.scatter.src, aten.scatter_add.default)
def scatter(info: OpInfo):
    dim = norm_dim(info.args[1], info.inputs[0].ndim)
    k = len(info.inputs)
    res = [AxisStrategy((S(d),) * k, (S(d),)) for d in _aligned(info, dim)]
    if k == 3:  # with a source tensor: linear in (input, src) jointly for a fixed index
        res += partial_through(info, (0, 2))
    return res


@register(aten.index_select.default)
def index_select(info: OpInfo):
    x = info.inputs[0]
    dim = norm_dim(info.args[1], x.ndim)
    res = [AxisStrategy((S(d), R), (S(d),)) for d in range(x.ndim) if d != dim]
    res.append(AxisStrategy((R, S(0)), (S(dim),)))
    return res + partial_through(info, (0,))


@register(aten.constant_pad_nd.default)
def constant_pad_nd(info: OpInfo):
    n = info.inputs[0].ndim
    pad = list(info.args[1])
    padded = {n - 1 - i // 2 for i, p in enumerate(pad) if p != 0}
    value = arg(info, 2, "value", 0)
    return dim_map(info, {d: d for d in range(n) if d not in padded}, linear=value == 0)


def _advanced(indices: Sequence) -> tuple[list[int], tuple[int, ...], bool] | None:
    """(indexed dims of self, broadcast shape of the index tensors, whether the indexed dims are adjacent), or
    None for boolean masks (whose result size depends on the data) and for no index at all."""
    tensors = [t for t in indices if t is not None]
    if not tensors or any(t.dtype == torch.bool for t in tensors):
        return None
    dims = [i for i, t in enumerate(indices) if t is not None]
    shape = tuple(torch.broadcast_shapes(*(t.shape for t in tensors)))
    return dims, shape, dims[-1] - dims[0] + 1 == len(dims)


def _result_dims(ndim: int, dims: list[int], bshape: tuple, adjacent: bool) -> tuple[dict[int, int], int]:
    """Where `self[indices]` puts each non-indexed dim of self, and the first dim of the broadcast index block
    (at the first indexed dim when the indexed dims are adjacent, in front otherwise)."""
    free = [d for d in range(ndim) if d not in dims]
    if adjacent:
        return {d: d if d < dims[0] else d - len(dims) + len(bshape) for d in free}, dims[0]
    return {d: len(bshape) + k for k, d in enumerate(free)}, 0


@register(aten.index.Tensor, aten._unsafe_index.Tensor)
def index(info: OpInfo):
    # inputs: self, then the index tensors given (None entries take whole dims)
    x, indices = info.inputs[0], info.args[1]
    adv = _advanced(indices)
    if adv is None:
        return []
    dims, bshape, adjacent = adv
    free, start = _result_dims(x.ndim, dims, bshape, adjacent)
    idx = info.inputs[1:]
    res = [AxisStrategy((S(d),) + (R,) * len(idx), (S(j),)) for d, j in free.items()]
    # Rows of the index block: each rank looks up its own index rows in the whole of self.
    res += [AxisStrategy((R,) + tuple(bcast(t, j, len(bshape)) for t in idx), (S(start + j),))
            for j in range(len(bshape))]
    # A lookup is linear in the table.
    return res + partial_through(info, (0,))


@register(aten.index_put.default, aten._unsafe_index_put.default)
def index_put(info: OpInfo):
    # inputs: self, the index tensors, values; output: self with values written (or added) at the indices
    x, indices, values = info.inputs[0], info.args[1], info.inputs[-1]
    adv = _advanced(indices)
    if adv is None:
        return []
    dims, bshape, adjacent = adv
    free, start = _result_dims(x.ndim, dims, bshape, adjacent)
    idx = info.inputs[1:-1]
    rank = x.ndim - len(dims) + len(bshape)  # of self[indices], which values broadcast to
    res = [AxisStrategy((S(d),) + (R,) * len(idx) + (bcast(values, j, rank),), (S(d),)) for d, j in free.items()]
    if arg(info, 3, "accumulate", False):
        # Each rank adds its rows of values at its rows of indices; with self split in parts, the parts sum.
        res += [AxisStrategy((P,) + tuple(bcast(t, j, len(bshape)) for t in idx)
                             + (bcast(values, start + j, rank),), (P,)) for j in range(len(bshape))]
    # Writing (or adding) values into self is linear in (self, values) jointly.
    return res + partial_through(info, (0, len(info.inputs) - 1))
