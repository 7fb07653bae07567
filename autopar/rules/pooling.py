"""Pooling and upsampling kernels, forward and backward: the leading (batch and channel) dims shard, the
trailing spatial dims stay whole.

A window sliding over a sharded spatial dim would need rows from the neighbouring rank (a halo exchange the
rule table cannot express), so spatial layouts are never offered. Every tensor of these ops (input, output, max
pooling's indices, which are offsets within one spatial plane) has the same leading dims, so one Shard moves
them all alike. The table gives each op's number of spatial dims and whether it is linear in grad_output or the
input (averaging and interpolation are; a max is not in its input, but its backward scatters grad_output
linearly). 1-D pooling is traced as 2-D pooling of an unsqueezed tensor; interpolate usually decomposes into
`_unsafe_index` (indexing.py), but the upsample kernels are covered for graphs that keep them.
"""
from __future__ import annotations

import torch

from autopar.layout import S
from autopar.rules.base import AxisStrategy, OpInfo
from autopar.rules.common import partial_through
from autopar.rules.registry import register

aten = torch.ops.aten

# op -> (spatial dims, linear in input 0)
SPATIAL_OPS: dict[object, tuple[int, bool]] = {
    aten.max_pool2d_with_indices.default: (2, False),
    aten.max_pool3d_with_indices.default: (3, False),
    aten.adaptive_max_pool2d.default: (2, False),
    aten.adaptive_max_pool3d.default: (3, False),
    # Backward of a max: grad_output scattered to the argmax positions, linear in grad_output.
    aten.max_pool2d_with_indices_backward.default: (2, True),
    aten.max_pool3d_with_indices_backward.default: (3, True),
    aten.adaptive_max_pool2d_backward.default: (2, True),
    aten.adaptive_max_pool3d_backward.default: (3, True),
    # Averages with fixed weights, and their transposes.
    aten.avg_pool2d.default: (2, True),
    aten.avg_pool3d.default: (3, True),
    aten._adaptive_avg_pool2d.default: (2, True),
    aten._adaptive_avg_pool3d.default: (3, True),
    aten.avg_pool2d_backward.default: (2, True),
    aten.avg_pool3d_backward.default: (3, True),
    aten._adaptive_avg_pool2d_backward.default: (2, True),
    aten._adaptive_avg_pool3d_backward.default: (3, True),
    # Interpolation: each output is a fixed weighted sum of inputs; the backward is its transpose.
    aten.upsample_nearest1d.default: (1, True),
    aten.upsample_nearest2d.default: (2, True),
    aten.upsample_nearest3d.default: (3, True),
    aten.upsample_linear1d.default: (1, True),
    aten.upsample_bilinear2d.default: (2, True),
    aten.upsample_bicubic2d.default: (2, True),
    aten.upsample_trilinear3d.default: (3, True),
    aten.upsample_nearest1d_backward.default: (1, True),
    aten.upsample_nearest2d_backward.default: (2, True),
    aten.upsample_nearest3d_backward.default: (3, True),
    aten.upsample_linear1d_backward.default: (1, True),
    aten.upsample_bilinear2d_backward.default: (2, True),
    aten.upsample_bicubic2d_backward.default: (2, True),
    aten.upsample_trilinear3d_backward.default: (3, True),
}


@register(*SPATIAL_OPS)
def spatial(info: OpInfo):
    n_spatial, linear = SPATIAL_OPS[info.target]
    lead = info.inputs[0].ndim - n_spatial
    res = [AxisStrategy((S(d),) * len(info.inputs), (S(d),) * len(info.outputs)) for d in range(lead)]
    return res + (partial_through(info, (0,)) if linear else [])
