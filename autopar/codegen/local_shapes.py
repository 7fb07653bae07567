"""Rewrite the shape-carrying arguments of one op for local shards (view sizes, factory sizes, slice bounds).

Each rewrite gets the node's arguments (tensors already replaced by their local versions), the global
input/output shapes and the planned layouts. Ops whose meaning depends on global positions along a sharded
dim (a real slice, split, select, cat, an index into a sharded table) are refused with CodegenError:
the sharding rules must not offer those layouts, and codegen says so rather than compute a wrong value.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor import Placement, Shard

from autopar.codegen.builder import CodegenError
from autopar.layout import fmt_layout, local_shape

aten = torch.ops.aten


@dataclasses.dataclass
class OpSite:
    """One node being localized: its global shapes and planned layouts."""

    node: fx.Node
    name: str
    in_shapes: list[tuple[int, ...]]
    in_layouts: list[tuple[Placement, ...] | None]
    out_shapes: list[tuple[int, ...] | None]
    out_layouts: list[tuple[Placement, ...]]
    axis_sizes: tuple[int, ...]

    def local_out(self, i: int = 0) -> list[int]:
        return list(local_shape(self.out_shapes[i], self.out_layouts[i], self.axis_sizes))

    def sharded_in(self, i: int, dim: int) -> bool:
        lay = self.in_layouts[i]
        nd = len(self.in_shapes[i])
        return lay is not None and any(isinstance(p, Shard) and p.dim == dim % max(nd, 1) for p in lay)

    def sharded_out(self, i: int, dim: int) -> bool:
        nd = len(self.out_shapes[i] or ())
        return any(isinstance(p, Shard) and p.dim == dim % max(nd, 1) for p in self.out_layouts[i])

    def refuse(self, why: str) -> CodegenError:
        ins = " ".join(fmt_layout(x) if x is not None else "-" for x in self.in_layouts)
        outs = " ".join(fmt_layout(x) for x in self.out_layouts)
        return CodegenError(f"cannot run {self.name} ({self.node.target}) locally under layouts {ins} -> {outs}: "
                            f"{why}. The sharding rule for this op must not offer this layout.")


Rewrite = Callable[[OpSite, list, dict], tuple[list, dict]]
_REWRITES: dict[Any, Rewrite] = {}


def rewrite(*targets):
    def deco(fn):
        for t in targets:
            _REWRITES[t] = fn
        return fn
    return deco


def localize(site: OpSite, args: list, kwargs: dict) -> tuple[Any, list, dict]:
    """(target, args, kwargs) for this rank: the rules' shape-argument table first (autopar.rules.local_call),
    then the checks and rewrites below for ops outside it."""
    from autopar import rules
    from autopar.rules.base import op_info

    fn = _REWRITES.get(site.node.target)
    if fn is not None:
        args, kwargs = fn(site, list(args), dict(kwargs))
    target, args, kwargs = rules.local_call(op_info(site.node), args, kwargs, expected_local_shapes(site))
    return target, list(args), dict(kwargs)


def _is_sharded(site: OpSite) -> bool:
    return any(isinstance(p, Shard) for p in site.out_layouts[0]) if site.out_layouts else False


# --- sizes taken from the output's local shape (views and new_* are in autopar.rules.SHAPE_ARGS) --------
@rewrite(aten.full.default, aten.zeros.default, aten.ones.default, aten.empty.memory_format)
def _size_arg0(site, args, kwargs):
    args[0] = site.local_out()
    return args, kwargs


@rewrite(aten.empty_strided.default, aten.new_empty_strided.default)
def _strided(site, args, kwargs):
    i = 0 if site.node.target is aten.empty_strided.default else 1
    shape = site.local_out()
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    args[i], args[i + 1] = shape, list(reversed(stride))
    return args, kwargs


@rewrite(aten.arange.default, aten.arange.start, aten.arange.start_step, aten.rand.default, aten.randn.default,
         aten.randint.low, aten.randint.default, aten.randperm.default)
def _no_sharded_factory(site, args, kwargs):
    if _is_sharded(site):
        raise site.refuse("a sharded output of this factory needs per-rank offsets or random streams")
    return args, kwargs


# --- ops that index along a dim: legal only when that dim is whole ------------------------------------
def _whole_range(start, end, step, size) -> bool:
    return start in (None, 0, -size) and step in (None, 1) and (end is None or end >= size)


@rewrite(aten.slice.Tensor)
def _slice(site, args, kwargs):
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    start = args[2] if len(args) > 2 else kwargs.get("start")
    end = args[3] if len(args) > 3 else kwargs.get("end")
    step = args[4] if len(args) > 4 else kwargs.get("step", 1)
    if site.sharded_in(0, dim):
        size = site.in_shapes[0][dim]
        if not _whole_range(start, end, step, size):
            raise site.refuse(f"slice [{start}:{end}:{step}] of sharded dim {dim}")
    return args, kwargs


@rewrite(aten.slice_backward.default)
def _slice_backward(site, args, kwargs):
    dim, start, end, step = args[2], args[3], args[4], args[5]
    if site.sharded_out(0, dim) and not _whole_range(start, end, step, site.out_shapes[0][dim]):
        raise site.refuse(f"slice_backward [{start}:{end}:{step}] into sharded dim {dim}")
    return args, kwargs


@rewrite(aten.select.int, aten.select_backward.default)
def _select(site, args, kwargs):
    if site.node.target is aten.select.int:
        if site.sharded_in(0, args[1]):
            raise site.refuse(f"select of an index along sharded dim {args[1]}")
        return args, kwargs
    if site.sharded_out(0, args[2]):
        raise site.refuse(f"select_backward along sharded dim {args[2]}")
    return args, kwargs


@rewrite(aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int, aten.narrow.default)
def _split(site, args, kwargs):
    t = site.node.target
    if t is aten.narrow.default:
        dim = args[1]
    elif t is aten.unbind.int:
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    else:
        dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    if site.sharded_in(0, dim):
        raise site.refuse(f"splitting along sharded dim {dim} would mix the chunks of different ranks")
    return args, kwargs


@rewrite(aten.cat.default)
def _cat(site, args, kwargs):
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if site.sharded_out(0, dim):
        raise site.refuse(f"concatenating along sharded dim {dim} would interleave the ranks' shards")
    return args, kwargs


@rewrite(aten.embedding_dense_backward.default)
def _embedding_backward(site, args, kwargs):
    if site.sharded_out(0, 0):
        raise site.refuse("a vocabulary-sharded embedding gradient needs token ids offset per rank")
    args[2] = site.local_out()[0]
    return args, kwargs


@rewrite(aten.embedding.default)
def _embedding(site, args, kwargs):
    if site.sharded_in(0, 0):
        raise site.refuse("a vocabulary-sharded embedding table needs token ids offset and masked per rank")
    return args, kwargs


@rewrite(aten.gather.default, aten.scatter.value, aten.scatter.src, aten.scatter_add.default,
         aten.index_select.default)
def _index_dim(site, args, kwargs):
    dim = args[1]
    if site.sharded_in(0, dim):
        raise site.refuse(f"indexing along sharded dim {dim}")
    return args, kwargs


@rewrite(aten._softmax.default, aten._log_softmax.default)
def _softmax(site, args, kwargs):
    if site.sharded_in(0, args[1]):
        raise site.refuse(f"softmax over sharded dim {args[1]}")
    return args, kwargs


@rewrite(aten.native_layer_norm.default)
def _layer_norm(site, args, kwargs):
    normalized = list(args[1])
    nd = len(site.in_shapes[0])
    for d in range(nd - len(normalized), nd):
        if site.sharded_in(0, d):
            raise site.refuse(f"layer norm statistics over sharded dim {d}")
    return args, kwargs


def local_device_kwargs(kwargs: dict, device: str) -> dict:
    """Factory/copy ops recorded on the capture device run on this rank's device."""
    if "device" in kwargs and kwargs["device"] is not None:
        kwargs = dict(kwargs, device=torch.device(device))
    return kwargs


def expected_local_shapes(site: OpSite) -> list[tuple[int, ...] | None]:
    return [tuple(local_shape(s, lay, site.axis_sizes)) if s is not None else None
            for s, lay in zip(site.out_shapes, site.out_layouts)]


def describe_shapes(shapes: Sequence) -> str:
    return ", ".join(str(list(s)) if s is not None else "-" for s in shapes)
