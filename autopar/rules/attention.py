"""Scaled dot-product attention kernels (every backend, forward and backward): shard batch or heads, never the
sequence."""
from __future__ import annotations

import torch
from torch.distributed.tensor import Placement

from autopar.layout import P, R, S
from autopar.rules.base import AxisStrategy, OpInfo, TensorMeta
from autopar.rules.registry import register

aten = torch.ops.aten

_FORWARD = ["_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
            "_scaled_dot_product_attention_math", "_scaled_dot_product_fused_attention_overrideable"]
_BACKWARD = ["_scaled_dot_product_flash_attention_for_cpu_backward", "_scaled_dot_product_flash_attention_backward",
             "_scaled_dot_product_efficient_attention_backward", "_scaled_dot_product_cudnn_attention_backward",
             "_scaled_dot_product_fused_attention_overrideable_backward"]


def _in(meta: TensorMeta | None, dim: int) -> Placement:
    """(batch, heads, ...) tensors — q, k, v, masks, outputs, logsumexp — shard; a size-1 (broadcast) dim and
    auxiliary tensors (rng state, philox seeds, cumulative sequence lengths: fewer than 3 dims) replicate."""
    return S(dim) if meta is not None and meta.ndim >= 3 and meta.shape[dim] > 1 else R


def _out(meta: TensorMeta | None, dim: int, backward: bool) -> Placement:
    # The gradient of a mask broadcast over the sharded dim is summed over the local rows only.
    if backward and meta is not None and meta.ndim >= 3 and meta.shape[dim] == 1:
        return P
    return _in(meta, dim)


def _rule(backward: bool):
    def rule(info: OpInfo) -> list[AxisStrategy]:
        # Forward: input 0 is the query; backward: input 0 is grad_out, of the query's batch and heads.
        ref = info.inputs[0]
        res = []
        for dim in (0, 1):
            if ref.ndim == 4 and ref.shape[dim] > 1:
                res.append(AxisStrategy(tuple(_in(m, dim) for m in info.inputs),
                                        tuple(_out(m, dim, backward) for m in info.outputs)))
        return res
    return rule


def _ops(names: list[str]) -> list:
    return [getattr(aten, n).default for n in names if hasattr(aten, n)]


register(*_ops(_FORWARD))(_rule(backward=False))
register(*_ops(_BACKWARD))(_rule(backward=True))
