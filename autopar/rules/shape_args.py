"""Arguments that depend on global shapes, and how a per-rank program passes them: shape arguments become the
local shape of their output, integer sizes (a group norm's batch and channel counts, a grouped convolution's
groups, repeat's repeats) take the rank's share, and squeezes name the dims that are size 1 globally (a sharded
dim may be size 1 on a rank and must not be squeezed there)."""
from __future__ import annotations

from typing import Sequence

import torch

from autopar.rules.conv import local_groups
from autopar.rules.norms import group_norm_sizes
from autopar.rules.views import local_repeats

aten = torch.ops.aten

# op -> ((argument position, index of the output whose shape it gives), ...)
SHAPE_ARGS: dict[object, tuple[tuple[int, int], ...]] = {
    aten.view.default: ((1, 0),),
    aten._unsafe_view.default: ((1, 0),),
    aten.reshape.default: ((1, 0),),
    aten.expand.default: ((1, 0),),
    aten.new_zeros.default: ((1, 0),),
    aten.new_ones.default: ((1, 0),),
    aten.new_empty.default: ((1, 0),),
    aten.new_full.default: ((1, 0),),
    aten.slice_backward.default: ((1, 0),),
    aten.select_backward.default: ((1, 0),),
    aten.convolution_backward.default: ((3, 2),),
    # Upsampling backward takes the input's size.
    **{op: ((2, 0),) for op in (aten.upsample_nearest1d_backward.default, aten.upsample_nearest2d_backward.default,
                               aten.upsample_nearest3d_backward.default, aten.upsample_linear1d_backward.default,
                               aten.upsample_bilinear2d_backward.default, aten.upsample_bicubic2d_backward.default,
                               aten.upsample_trilinear3d_backward.default)},
}


def local_call(info, args: Sequence, kwargs: dict,
               local_out_shapes: Sequence[Sequence[int] | None]) -> tuple[object, tuple, dict]:
    """(target, args, kwargs) to run on one rank, given the node's global OpInfo and the rank's output shapes."""
    target = info.target
    if target in (aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims):
        shape = info.inputs[0].shape
        dims = range(len(shape)) if target is aten.squeeze.default else info.args[1]
        dims = [dims] if isinstance(dims, int) else dims
        keep = [d for d in dims if shape[d] == 1]
        return aten.squeeze.dims, (args[0], keep), {}
    args, kwargs = localize_args(target, args, kwargs, local_out_shapes)
    fix = _SIZE_FIXES.get(target)
    if fix is not None:
        args = list(args)
        for pos, value in fix(info, args, local_out_shapes).items():
            args[pos] = value
    return target, tuple(args), kwargs


def _shape(x) -> tuple[int, ...]:
    """Local shape of an argument: a tensor here, a traced node (with its fake value) in codegen."""
    val = x.meta["val"] if isinstance(x, torch.fx.Node) else x
    return tuple(int(s) for s in val.shape)


def _conv_groups(info, args, local_out_shapes) -> dict[int, int]:
    pos, x = (8, args[0]) if info.target is aten.convolution.default else (9, args[1])
    return {pos: local_groups(info, _shape(x)[1])}


def _group_norm_sizes(info, args, local_out_shapes) -> dict[int, int]:
    return group_norm_sizes(info, _shape(args[1] if info.target is aten.native_group_norm_backward.default
                                         else args[0]))


def _repeats(info, args, local_out_shapes) -> dict[int, list[int]]:
    return {1: local_repeats(info, local_out_shapes[0])}


# Integer arguments counted in whole-tensor units (batch size, channel groups, repeats): op -> the values for a
# rank, by argument position. These ops take their arguments positionally in traced graphs.
_SIZE_FIXES = {
    aten.convolution.default: _conv_groups,
    aten.convolution_backward.default: _conv_groups,
    aten.native_group_norm.default: _group_norm_sizes,
    aten.native_group_norm_backward.default: _group_norm_sizes,
    aten.repeat.default: _repeats,
}


def localize_args(target, args: Sequence, kwargs: dict,
                  local_out_shapes: Sequence[Sequence[int] | None]) -> tuple[tuple, dict]:
    """`args`/`kwargs` with every shape argument of `target` replaced by the local shape of its output."""
    entries = SHAPE_ARGS.get(target, ())
    if not entries:
        return tuple(args), dict(kwargs)
    args, kwargs = list(args), dict(kwargs)
    names = [a.name for a in target._schema.arguments]
    for pos, out_index in entries:
        shape = local_out_shapes[out_index]
        if shape is None:
            continue
        if pos < len(args):
            args[pos] = list(shape)
        elif names[pos] in kwargs:
            kwargs[names[pos]] = list(shape)
    return tuple(args), kwargs
