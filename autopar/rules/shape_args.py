"""Arguments that depend on global shapes, and how a per-rank program passes them: shape arguments become the
local shape of their output, and squeezes name the dims that are size 1 globally (a sharded dim may be size 1
on a rank and must not be squeezed there)."""
from __future__ import annotations

from typing import Sequence

import torch

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
    return (target,) + localize_args(target, args, kwargs, local_out_shapes)


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
