"""The private-API boundary for the fallback: DTensor's own one-axis strategy for an op that has no autopar rule.

Everything here reaches into torch.distributed.tensor internals (the sharding propagator's strategy tables,
OpSchema, DTensorSpec); a torch upgrade that moves them makes `dtensor_strategies` return None, which only
costs the op its non-replicated strategies. Old-style strategy functions need a DeviceMesh: a 2-rank mesh
that never initializes a process group (`autopar._torch_compat.device_mesh_without_backend`).
"""
from __future__ import annotations

import functools
from typing import Any

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar.layout import R
from autopar.rules.base import AxisStrategy, OpInfo, TensorMeta


def dtensor_strategies(info: OpInfo) -> list[AxisStrategy] | None:
    """DTensor's strategies for `info.target` on one mesh axis, or None if it has none we can use."""
    try:
        rows = _single_dim_rows(info)
        if rows is None:
            rows = _op_strategy_rows(info)
    except Exception:  # noqa: BLE001 - private API: any failure just means no fallback
        return None
    if rows is None:
        return None
    n_out = len(info.outputs)
    res = []
    for outs, ins in rows:
        if len(outs) != n_out or len(ins) != len(info.inputs):
            continue
        pls = [_placement(p) for p in list(outs) + list(ins)]
        if all(p is not None for p in pls):
            res.append(AxisStrategy(tuple(pls[n_out:]), tuple(pls[:n_out])))
    return res


def _placement(p: Any):
    """Plain Shard/Replicate/Partial(sum|avg) as is; DTensor's placeholders become Shard; others are unusable."""
    if p is None:
        return R
    if type(p).__name__ == "_ShardingPlaceholder":
        return Shard(p.dim)
    if type(p) in (Shard, Replicate):
        return p
    if type(p) is Partial and p.reduce_op in ("sum", "avg"):
        return p
    return None


def _propagator():
    from torch.distributed.tensor import DTensor

    return DTensor._op_dispatcher.sharding_propagator


def _dt_meta(m: TensorMeta):
    from torch.distributed.tensor._dtensor_spec import TensorMeta as DTMeta

    stride, acc = [], 1
    for s in reversed(m.shape):
        stride.append(acc)
        acc *= max(s, 1)
    return DTMeta(torch.Size(m.shape), tuple(reversed(stride)), m.dtype)


def _map(x: Any, fn) -> Any:
    if isinstance(x, TensorMeta):
        return fn(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_map(a, fn) for a in x)
    if isinstance(x, dict):
        return {k: _map(v, fn) for k, v in x.items()}
    return x


def _single_dim_rows(info: OpInfo):
    fn = _propagator().op_single_dim_strategy_funcs.get(info.target)
    if fn is None:
        return None
    rows = fn(info.target, _map(info.args, _dt_meta), _map(info.kwargs, _dt_meta))
    n_out = len(info.outputs)
    return [(row[:n_out], row[n_out:]) for row in rows]


@functools.lru_cache(maxsize=1)
def _mesh():
    from autopar import _torch_compat as compat

    return compat.device_mesh_without_backend("cpu", torch.arange(2), ("x",))


def _op_strategy_rows(info: OpInfo):
    fn = _propagator().op_strategy_funcs.get(info.target)
    if fn is None:
        return None
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy

    mesh = _mesh()

    def candidates(m: TensorMeta):
        # Offer every placement an input could arrive in; strategy functions pick the ones they accept.
        pls = [Replicate()] + [Shard(d) for d in range(m.ndim) if m.shape[d] > 1]
        return OpStrategy([OpSpec(DTensorSpec(mesh, (p,), tensor_meta=_dt_meta(m))) for p in pls])

    strategy = fn(OpSchema(info.target, _map(info.args, candidates), _map(info.kwargs, candidates)))
    rows = []
    for spec in getattr(strategy, "strategies", []):
        outs = spec.output_specs if isinstance(spec.output_specs, (list, tuple)) else (spec.output_specs,)
        if spec.input_specs is None:
            continue
        rows.append(([None if o is None else o.placements[0] for o in outs],
                     [i.placements[0] for i in spec.input_specs]))
    return rows
