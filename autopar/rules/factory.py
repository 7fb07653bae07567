"""Tensor-creating ops: factories without tensor inputs replicate; `*_like`, `new_*` and fill follow their input."""
from __future__ import annotations

import torch

from autopar.layout import R, S
from autopar.rules.base import AxisStrategy, OpInfo
from autopar.rules.common import dim_map, partial_through
from autopar.rules.registry import register

aten = torch.ops.aten


@register(aten.scalar_tensor, aten.full, aten.zeros, aten.ones, aten.empty, aten.empty_strided, aten.arange)
def factory(info: OpInfo):
    """No tensor input: all-replicate, which the registry adds, is the only strategy."""
    return []


def _like(info: OpInfo, zeros: bool):
    res = dim_map(info, {d: d for d in range(info.inputs[0].ndim)}, linear=False)
    # Zeros are the sum of zeros (and their mean).
    return res + (partial_through(info, (0,)) if zeros else [])


@register(aten.zeros_like.default)
def zeros_like(info: OpInfo):
    return _like(info, zeros=True)


@register(aten.ones_like.default, aten.empty_like.default, aten.full_like.default, aten.fill.Scalar)
def like(info: OpInfo):
    return _like(info, zeros=False)


@register(aten.fill.Tensor)
def fill_tensor(info: OpInfo):
    # inputs: self, value (0-d); the result is the value broadcast, so a Partial value gives a Partial result.
    n = info.inputs[0].ndim
    return [AxisStrategy((S(d), R), (S(d),)) for d in range(n)] + partial_through(info, (1,))


@register(aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default, aten.new_full.default)
def new_like(info: OpInfo):
    """Only the input's dtype and device matter: the output may be sharded on any dim (the size argument is
    rewritten to the local shape); an input of the same shape is sharded alike so it need not be gathered."""
    x, out = info.inputs[0], info.outputs[0]
    same = x.shape == out.shape
    res = [AxisStrategy((S(d) if same else R,), (S(d),)) for d in range(out.ndim)]
    if info.target is aten.new_zeros.default:
        res += partial_through(info, (0,))
    return res
