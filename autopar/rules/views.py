"""Layout ops (reshape, expand, squeeze, transpose, permute, aliases): where a Shard on an input dim lands."""
from __future__ import annotations

import math
from typing import Sequence

import torch

from autopar.rules.base import OpInfo
from autopar.rules.common import arg, dim_map, norm_dim
from autopar.rules.registry import register

aten = torch.ops.aten


def dim_groups(src: Sequence[int], dst: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Pair up runs of input and output dims with equal products (a reshape's dim grouping).

    A size-1 dim facing a dim of another size forms a group of its own (on one side only).
    """
    i = j = 0
    groups: list[tuple[list[int], list[int]]] = []
    while i < len(src) or j < len(dst):
        if i < len(src) and src[i] == 1 and (j >= len(dst) or dst[j] != 1):
            groups.append(([i], []))
            i += 1
        elif j < len(dst) and dst[j] == 1 and (i >= len(src) or src[i] != 1):
            groups.append(([], [j]))
            j += 1
        else:
            gi, gj, pa, pb = [i], [j], src[i], dst[j]
            i, j = i + 1, j + 1
            while pa != pb:
                if pa < pb:
                    gi.append(i)
                    pa *= src[i]
                    i += 1
                else:
                    gj.append(j)
                    pb *= dst[j]
                    j += 1
            groups.append((gi, gj))
    return groups


def reshape_map(src: Sequence[int], dst: Sequence[int]) -> dict[int, int]:
    """Input dim -> output dim a Shard survives a reshape on: the outermost non-trivial input dim of each group
    maps to the group's outermost non-trivial output dim (a contiguous block of rows stays contiguous)."""
    if 0 in src or 0 in dst or math.prod(src) != math.prod(dst):
        return {}  # empty tensors: nothing worth sharding
    mapping = {}
    for gi, gj in dim_groups(src, dst):
        a = next((d for d in gi if src[d] > 1), None)
        b = next((d for d in gj if dst[d] > 1), None)
        if a is not None and b is not None:
            mapping[a] = b
    return mapping


@register(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def reshape(info: OpInfo):
    return dim_map(info, reshape_map(info.inputs[0].shape, info.outputs[0].shape))


@register(aten.expand.default)
def expand(info: OpInfo):
    src, dst = info.inputs[0].shape, info.outputs[0].shape
    off = len(dst) - len(src)
    kept = {i: i + off for i in range(len(src)) if src[i] == dst[i + off]}
    new = [j for j in range(len(dst)) if j < off or src[j - off] != dst[j]]
    return dim_map(info, kept, new_dims=new)


@register(aten.repeat.default)
def repeat(info: OpInfo):
    # A dim repeated more than once interleaves copies of the whole input: it shards only where the input has
    # size 1 there (or lacks the dim), each rank making its share of the copies (repeats become local).
    src, reps = info.inputs[0].shape, info.args[1]
    off = len(reps) - len(src)
    kept = {i: i + off for i in range(len(src)) if reps[i + off] == 1}
    new = [j for j in range(len(reps)) if j < off or src[j - off] == 1]
    return dim_map(info, kept, new_dims=new)


def local_repeats(info: OpInfo, local_out_shape) -> list[int]:
    """repeat's repeats for a rank holding `local_out_shape` of the output (see `repeat`)."""
    src, reps = info.inputs[0].shape, info.args[1]
    off = len(reps) - len(src)
    return [int(local_out_shape[j]) if j < off or src[j - off] == 1 else r for j, r in enumerate(reps)]


@register(aten.unsqueeze.default)
def unsqueeze(info: OpInfo):
    n = info.inputs[0].ndim
    dim = norm_dim(info.args[1], n + 1)
    return dim_map(info, {i: i if i < dim else i + 1 for i in range(n)})


@register(aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims)
def squeeze(info: OpInfo):
    shape = info.inputs[0].shape
    dims = arg(info, 1, "dim", None)
    dims = range(len(shape)) if dims is None else [dims] if isinstance(dims, int) else dims
    gone = {norm_dim(d, len(shape)) for d in dims if shape[norm_dim(d, len(shape))] == 1}
    kept = [i for i in range(len(shape)) if i not in gone]
    return dim_map(info, {i: k for k, i in enumerate(kept)})


@register(aten.t.default)
def t(info: OpInfo):
    n = info.inputs[0].ndim
    return dim_map(info, {0: 1, 1: 0} if n == 2 else {i: i for i in range(n)})


@register(aten.transpose.int)
def transpose(info: OpInfo):
    n = info.inputs[0].ndim
    a, b = norm_dim(info.args[1], n), norm_dim(info.args[2], n)
    perm = list(range(n))
    perm[a], perm[b] = perm[b], perm[a]
    return dim_map(info, {perm[j]: j for j in range(n)})


@register(aten.permute.default)
def permute(info: OpInfo):
    n = info.inputs[0].ndim
    return dim_map(info, {norm_dim(d, n): j for j, d in enumerate(info.args[1])})


@register(aten.alias.default, aten.detach.default, aten.lift_fresh_copy.default, aten.contiguous.default)
def identity(info: OpInfo):
    return dim_map(info, {i: i for i in range(info.inputs[0].ndim)})


@register(aten.unbind.int)
def unbind(info: OpInfo):
    n = info.inputs[0].ndim
    dim = norm_dim(arg(info, 1, "dim", 0), n)
    return dim_map(info, {i: i if i < dim else i - 1 for i in range(n) if i != dim})


__all__ = ["dim_groups", "reshape_map", "local_repeats"]
