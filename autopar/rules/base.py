"""The rule interface: an op's legal layouts on one mesh axis, as pure functions of tensor metadata."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch
from torch.distributed.tensor import Placement

from autopar.layout import P, R, S


@dataclasses.dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclasses.dataclass(frozen=True)
class OpInfo:
    """What a rule sees of one node: the op, its non-tensor arguments, and tensor metadata.

    `args`/`kwargs` are the node's arguments with every tensor replaced by its TensorMeta. `inputs` lists the
    tensor arguments in flattened (args, kwargs) order; rules return one input placement per entry.
    `outputs` lists the tensor outputs (one for most ops; several for ops returning tuples).
    """

    target: Any
    args: tuple
    kwargs: dict
    inputs: tuple[TensorMeta, ...]
    outputs: tuple[TensorMeta | None, ...]

    @property
    def name(self) -> str:
        return str(self.target)


@dataclasses.dataclass(frozen=True)
class AxisStrategy:
    """One legal way to run an op on one mesh axis: placement per tensor input and per output."""

    ins: tuple[Placement, ...]
    outs: tuple[Placement, ...]


Rule = Callable[[OpInfo], Sequence[AxisStrategy]]

ALL_R = "all-replicate"


def strat(ins: Sequence[Placement], outs: Placement | Sequence[Placement]) -> AxisStrategy:
    if isinstance(outs, Placement):
        outs = (outs,)
    return AxisStrategy(tuple(ins), tuple(outs))


__all__ = ["TensorMeta", "OpInfo", "AxisStrategy", "Rule", "strat", "R", "P", "S"]


def _meta_of(x: Any) -> Any:
    if isinstance(x, torch.fx.Node):
        v = x.meta.get("val")
        if isinstance(v, torch.Tensor):
            return TensorMeta(tuple(int(s) for s in v.shape), v.dtype)
        return v
    if isinstance(x, (list, tuple)):
        return type(x)(_meta_of(a) for a in x)
    return x


def flat_tensor_args(args: Sequence, kwargs: dict) -> list[Any]:
    """Tensor-valued leaves of (args, kwargs) in order: the positions rules assign input placements to."""
    out: list[Any] = []

    def walk(x):
        if isinstance(x, (list, tuple)):
            for a in x:
                walk(a)
        elif isinstance(x, (TensorMeta, torch.fx.Node, torch.Tensor)):
            out.append(x)

    walk(list(args))
    walk(list(kwargs.values()))
    return out


def op_info(node: torch.fx.Node) -> OpInfo:
    """OpInfo of a call_function node, from the fake values recorded at capture."""
    args = _meta_of(tuple(node.args))
    kwargs = {k: _meta_of(v) for k, v in node.kwargs.items()}
    tensor_nodes = [a for a in flat_tensor_args(node.args, node.kwargs)
                    if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]
    val = node.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else (val,)
    outs = tuple(TensorMeta(tuple(int(s) for s in v.shape), v.dtype) if isinstance(v, torch.Tensor) else None
                 for v in vals)
    return OpInfo(node.target, args, kwargs, tuple(_meta_of(a) for a in tensor_nodes), outs)
