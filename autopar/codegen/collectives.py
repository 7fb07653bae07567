"""Emit the redistribution steps of `autopar.redistribute.plan_steps` as functional collectives on local tensors.

Every step the cost model priced becomes exactly one collective (plus local reshuffles) or one local op:
all_gather and reduce_scatter work on dim 0, so other dims are moved there and back with permute + view;
all_to_all exchanges equal chunks of a leading axis. Partial(avg) reductions are a sum followed by a
division, so any backend (gloo has no AVG everywhere) computes the same.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from autopar.codegen.builder import Builder, CodegenError, RankSpec, local_val_shape
from autopar.redistribute import Step, plan_steps

aten = torch.ops.aten


def _c10d():
    from autopar import _torch_compat as compat

    return compat.c10d_functional_ops()


# Node meta naming what a collective carries (read by autopar.program's Collective list): the parameters or
# gradients of a bucket, or the value a single redistribution moves.
BUCKET_META = "autopar_bucket"
VALUE_META = "autopar_value"

COLLECTIVE_OPS = ("all_gather_into_tensor", "all_reduce", "all_reduce_", "reduce_scatter_tensor",
                  "all_to_all_single")


def collective_kind(node: fx.Node) -> str | None:
    """'all_gather' / 'all_reduce' / 'reduce_scatter' / 'all_to_all' for a functional collective node."""
    from autopar import _torch_compat as compat

    ns, op = compat.op_namespace_and_name(node.target)
    if ns != "_c10d_functional":
        return None
    return {"all_gather_into_tensor": "all_gather", "all_reduce": "all_reduce", "all_reduce_": "all_reduce",
            "reduce_scatter_tensor": "reduce_scatter", "all_to_all_single": "all_to_all"}.get(op)


def collective_group(node: fx.Node) -> str:
    return node.args[-1]


def redistribute(b: Builder, x: fx.Node, src: Sequence[Placement], dst: Sequence[Placement], rank: RankSpec,
                 phase: str, hint: str = "", what: str = "") -> fx.Node:
    """The local value of `x` (layout `src`) in layout `dst`; `hint` names the nodes, `what` says which value
    moves (recorded on each collective for the Program's listing)."""
    for st in checked_steps(tuple(src), tuple(dst), rank.axis_names):
        x = emit_step(b, x, st, rank, phase, hint, what)
    return x


def checked_steps(src: tuple, dst: tuple, axis_names: Sequence[str] = ()) -> list[Step]:
    """plan_steps(src, dst), checked against DTensor's nesting of shards (an internal invariant: the cost
    model priced exactly these steps)."""
    steps = plan_steps(src, dst)
    assert steps_valid(src, dst, steps), (src, dst, steps)
    return steps


def steps_valid(src: Sequence[Placement], dst: Sequence[Placement], steps: Sequence[Step]) -> bool:
    """Whether `steps` turn `src` into `dst` keeping every sharded dim nested in mesh order (an earlier axis
    splits first): a step may only gather, scatter or chunk a dim on the innermost axis that shards it."""
    cur = list(src)
    n = len(cur)

    def inner_free(a: int, d: int) -> bool:
        return not any(isinstance(cur[b], Shard) and cur[b].dim == d for b in range(a + 1, n))

    for st in steps:
        if st.flat:  # over a flattened group: the innermost axes of its dim, changed together
            ps = [cur[a] for a in st.flat]
            if st.kind == "all_gather":
                ok = all(p == Shard(st.dim) for p in ps) and inner_free(st.flat[-1], st.dim) and not any(
                    cur[b] == Shard(st.dim) for b in range(st.flat[0], n) if b not in st.flat)
                new = Replicate()
            elif st.kind == "reduce_scatter":
                ok = all(isinstance(p, Partial) for p in ps) and not any(
                    cur[b] == Shard(st.dim) for b in range(st.flat[0], n) if b not in st.flat)
                new = Shard(st.dim)
            elif st.kind == "all_reduce":
                ok, new = all(isinstance(p, Partial) for p in ps), Replicate()
            else:
                return False
            if not ok or len({p for p in ps}) != 1:
                return False
            for a in st.flat:
                cur[a] = new
            continue
        a, p = st.axis, cur[st.axis]
        if st.kind == "all_gather":
            ok, new = isinstance(p, Shard) and p.dim == st.dim and inner_free(a, st.dim), Replicate()
        elif st.kind == "chunk":
            ok, new = isinstance(p, Replicate) and inner_free(a, st.dim), Shard(st.dim)
        elif st.kind == "reduce_scatter":
            ok, new = isinstance(p, Partial) and inner_free(a, st.dim), Shard(st.dim)
        elif st.kind == "all_reduce":
            ok, new = isinstance(p, Partial), Replicate()
        elif st.kind == "all_to_all":
            ok = (isinstance(p, Shard) and p.dim == st.dim and inner_free(a, st.dim) and inner_free(a, st.dst_dim))
            new = Shard(st.dst_dim)
        elif st.kind == "partialize":
            ok, new = isinstance(p, Replicate), Partial(st.op)
        elif st.kind == "rescale":
            ok, new = isinstance(p, Partial), Partial("sum" if st.op == "avg_to_sum" else "avg")
        else:
            return False
        if not ok:
            return False
        cur[a] = new
    return tuple(cur) == tuple(dst)


def _contiguous(b: Builder, x: fx.Node, phase: str) -> fx.Node:
    """`x`, or a contiguous copy of it where its local value is a strided view (a transpose)."""
    val = x.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.is_contiguous():
        return x
    return b.call(aten.clone.default, (x,), {"memory_format": torch.contiguous_format}, phase=phase)


def step_group(rank: RankSpec, st: Step) -> str:
    """The process group a step's collective runs on: its axis's, or the flattened group of its axes."""
    if not st.flat:
        return rank.group_names[st.axis]
    group = rank.group_of_axes(st.flat)
    if group is None:
        raise CodegenError(f"rank {rank.rank} has no flattened process group over the mesh axes "
                           f"{'+'.join(rank.axis_names[a] for a in st.flat)} that {st.describe(rank.axis_names)} "
                           "runs on (runtime.rank_spec creates one per combination of axes)")
    return group


def emit_step(b: Builder, x: fx.Node, st: Step, rank: RankSpec, phase: str, hint: str = "",
              what: str = "") -> fx.Node:
    n = st.ranks(rank.axis_sizes)
    axis = "_".join(rank.axis_names[a] for a in st.axes)
    group = step_group(rank, st)
    c10d = _c10d()
    shape = list(local_val_shape(x))
    tag = f"{hint}_{axis}" if hint else axis

    def call(target, args, kwargs=None, name=None):
        node = b.call(target, args, kwargs, phase=phase, name=name)
        if collective_kind(node) is not None:
            node.meta[VALUE_META] = what or hint
        return node

    if st.kind in ("all_gather", "all_reduce", "reduce_scatter", "all_to_all"):
        x = _contiguous(b, x, phase)  # c10d's functional collectives take contiguous inputs (torch 2.11 checks)
    if st.kind == "all_gather":
        y = call(c10d.all_gather_into_tensor.default, (x, n, group), name=f"all_gather_{tag}")
        y = call(c10d.wait_tensor.default, (y,), name=f"wait_{tag}")
        return _move_leading(b, y, n, shape, st.dim, phase) if st.dim != 0 else y
    if st.kind == "all_reduce":
        op = _reduce_op(st.op)
        y = call(c10d.all_reduce.default, (x, "sum", group), name=f"all_reduce_{tag}")
        y = call(c10d.wait_tensor.default, (y,), name=f"wait_{tag}")
        return call(aten.div.Scalar, (y, n)) if op == "avg" else y
    if st.kind == "reduce_scatter":
        op = _reduce_op(st.op)
        inp = x if st.dim == 0 else _split_to_leading(b, x, n, shape, st.dim, phase)
        y = call(c10d.reduce_scatter_tensor.default, (inp, "sum", n, group), name=f"reduce_scatter_{tag}")
        y = call(c10d.wait_tensor.default, (y,), name=f"wait_{tag}")
        if st.dim != 0:
            out = list(shape)
            out[st.dim] //= n
            y = call(aten.view.default, (y, out))
        return call(aten.div.Scalar, (y, n)) if op == "avg" else y
    if st.kind == "all_to_all":
        inp = _split_to_leading(b, x, n, shape, st.dst_dim, phase)
        y = call(c10d.all_to_all_single.default, (inp, [1] * n, [1] * n, group), name=f"all_to_all_{tag}")
        y = call(c10d.wait_tensor.default, (y,), name=f"wait_{tag}")
        mid = list(shape)
        mid[st.dst_dim] //= n
        return _merge_leading(b, y, n, mid, st.dim, phase)
    if st.kind == "chunk":
        if shape[st.dim] % n:
            raise CodegenError(f"cannot chunk dim {st.dim} of size {shape[st.dim]} into {n} even shards on "
                               f"axis {axis!r}")
        m = shape[st.dim] // n
        c = rank.coords[st.axis]
        y = call(aten.slice.Tensor, (x, st.dim, c * m, (c + 1) * m), name=f"chunk_{tag}")
        return call(aten.clone.default, (y,), {"memory_format": torch.contiguous_format})
    if st.kind == "partialize":
        op = _reduce_op(st.op)
        if op == "sum" and rank.coords[st.axis] != 0:
            return call(aten.zeros_like.default, (x,), name=f"partial_zero_{tag}")
        return x
    if st.kind == "rescale":
        if st.op == "avg_to_sum":
            return call(aten.div.Scalar, (x, n), name=f"avg_to_sum_{tag}")
        if st.op == "sum_to_avg":
            return call(aten.mul.Scalar, (x, n), name=f"sum_to_avg_{tag}")
    raise CodegenError(f"unknown redistribution step {st}")


def _by_size(items: Sequence[tuple], bucket_bytes: int, first_bytes: int | None = None) -> list[list[tuple]]:
    """Consecutive items (name, node, ...) in groups of at most `bucket_bytes`, the first group of at most
    `first_bytes` (a larger item goes alone)."""
    groups: list[list[tuple]] = []
    size = 0
    for item in items:
        val = item[1].meta["val"]
        nbytes = val.numel() * val.element_size()
        cap = first_bytes if first_bytes is not None and len(groups) == 1 else bucket_bytes
        if not groups or (groups[-1] and size + nbytes > cap):
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += nbytes
    return groups


def bucketed_all_reduce(b: Builder, items: Sequence[tuple[str, fx.Node]], axes: Sequence[int], rank: RankSpec,
                        bucket_bytes: int, first_bytes: int | None = None) -> dict[str, fx.Node]:
    """Sum-all-reduce many tensors over one or more mesh axes (one after the other) with few collectives:
    flatten and concatenate up to `bucket_bytes` per bucket (`first_bytes` for the first, so the first
    reduction starts early), reduce once over the axes' flattened group (RankSpec.flat_groups) or else once per
    axis, and slice the results back into shape."""
    out: dict[str, fx.Node] = {}
    # Over several axes, one reduction over their flattened group when the rank has one, else one per axis.
    flat_group = rank.group_of_axes(tuple(sorted(axes))) if len(axes) > 1 else None
    groups = ([(flat_group, "_".join(rank.axis_names[a] for a in sorted(axes)))] if flat_group is not None
              else [(rank.group_names[a], rank.axis_names[a]) for a in axes])
    c10d = _c10d()
    for bucket in _by_size(items, bucket_bytes, first_bytes):
        flat = [b.call(aten.reshape.default, (x, [-1]), phase="bwd") for _, x in bucket]
        if len(flat) == 1:
            y, reduce = flat[0], c10d.all_reduce.default
        else:
            # The concatenated buffer belongs to this program alone: reduce it in place (the out-of-place
            # all_reduce would first copy it).
            y, reduce = b.call(aten.cat.default, (flat,), phase="bwd"), c10d.all_reduce_.default
        for group, tag in groups:
            y = b.call(reduce, (y, "sum", group), phase="bwd", name=f"all_reduce_grad_bucket_{tag}")
            y.meta[BUCKET_META] = tuple(fqn for fqn, _ in bucket)
            y = b.call(c10d.wait_tensor.default, (y,), phase="bwd", name=f"wait_grad_bucket_{tag}")
        offset = 0
        for fqn, x in bucket:
            shape = list(local_val_shape(x))
            n = math.prod(shape)
            part = b.call(aten.slice.Tensor, (y, 0, offset, offset + n), phase="bwd")
            out[fqn] = b.call(aten.view.default, (part, shape), phase="bwd")
            offset += n
    return out


def bucketed_reduce_scatter(b: Builder, items: Sequence[tuple[str, fx.Node, int]], axes: tuple[int, ...],
                            rank: RankSpec, bucket_bytes: int) -> dict[str, fx.Node]:
    """Sum-reduce-scatter many tensors over one axis, or the flattened group of several (each tensor on its own
    dim), with few collectives: each tensor's n chunks are stacked on a leading axis and flattened per chunk,
    the buckets are concatenated chunk-wise, one reduce_scatter leaves this rank's chunk of every tensor, which
    is sliced back into shape."""
    st = Step("reduce_scatter", axes[0], flat=tuple(axes) if len(axes) > 1 else ())
    n = st.ranks(rank.axis_sizes)
    group = step_group(rank, st)
    c10d = _c10d()
    out: dict[str, fx.Node] = {}
    for bucket in _by_size(items, bucket_bytes):
        rows = []
        for _, x, dim in bucket:
            stacked = _split_to_leading(b, x, n, list(local_val_shape(x)), dim, "bwd")
            rows.append(b.call(aten.reshape.default, (stacked, [n, -1]), phase="bwd"))
        cat = rows[0] if len(rows) == 1 else b.call(aten.cat.default, (rows, 1), phase="bwd")
        tag = "grad_bucket_" + "_".join(rank.axis_names[a] for a in axes)
        y = b.call(c10d.reduce_scatter_tensor.default, (cat, "sum", n, group), phase="bwd", name=f"reduce_scatter_{tag}")
        y.meta[BUCKET_META] = tuple(fqn for fqn, _, _ in bucket)
        y = b.call(c10d.wait_tensor.default, (y,), phase="bwd", name=f"wait_{tag}")
        y = b.call(aten.view.default, (y, [-1]), phase="bwd")
        offset = 0
        for fqn, x, dim in bucket:
            shape = list(local_val_shape(x))
            shape[dim] //= n
            size = math.prod(shape)
            part = b.call(aten.slice.Tensor, (y, 0, offset, offset + size), phase="bwd")
            out[fqn] = b.call(aten.view.default, (part, shape), phase="bwd")
            offset += size
    return out


@dataclasses.dataclass
class GatherBucket:
    """Parameters all-gathered together over one mesh axis or a flattened group of several (`axes`): members are
    (global param node, gathered dim), keys the (param, layout) lookups each member serves; `issued` is the
    collective once emitted."""

    axes: tuple[int, ...]
    phase: str
    members: list[tuple[fx.Node, int]]
    keys: list[tuple] = dataclasses.field(default_factory=list)
    issued: fx.Node | None = None
    done: bool = False


def emit_bucket_issue(b: Builder, bucket: GatherBucket, shards: Sequence[fx.Node], rank: RankSpec) -> fx.Node:
    """Start the bucket's all_gather: local shards flattened and concatenated; returns the collective node
    (not yet waited on)."""
    st = _bucket_step(bucket)
    flat = [b.call(aten.reshape.default, (x, [-1]), phase=bucket.phase) for x in shards]
    cat = b.call(aten.cat.default, (flat,), phase=bucket.phase)
    return b.call(_c10d().all_gather_into_tensor.default, (cat, st.ranks(rank.axis_sizes), step_group(rank, st)),
                  phase=bucket.phase, name="all_gather_bucket_" + "_".join(rank.axis_names[a] for a in st.axes))


def _bucket_step(bucket: GatherBucket) -> Step:
    return Step("all_gather", bucket.axes[0], flat=bucket.axes if len(bucket.axes) > 1 else ())


def emit_bucket_wait(b: Builder, bucket: GatherBucket, shards: Sequence[fx.Node], rank: RankSpec) -> list[fx.Node]:
    """Wait for the bucket's all_gather and cut out each member, gathered along its dim."""
    n = _bucket_step(bucket).ranks(rank.axis_sizes)
    phase = bucket.phase
    y = b.call(_c10d().wait_tensor.default, (bucket.issued,), phase=phase,
               name="wait_bucket_" + "_".join(rank.axis_names[a] for a in bucket.axes))
    y = b.call(aten.view.default, (y, [n, -1]), phase=phase)
    out, offset = [], 0
    for x, (_, dim) in zip(shards, bucket.members):
        shape = list(local_val_shape(x))
        size = math.prod(shape)
        part = b.call(aten.slice.Tensor, (y, 1, offset, offset + size), phase=phase)
        offset += size
        if dim == 0:
            out.append(b.call(aten.reshape.default, (part, [n * shape[0], *shape[1:]]), phase=phase))
        else:
            part = b.call(aten.reshape.default, (part, [n, *shape]), phase=phase)
            out.append(_merge_leading(b, part, n, shape, dim, phase))
    return out


def _reduce_op(op: str | None) -> str:
    if op in ("sum", "avg"):
        return op
    raise CodegenError(f"Partial({op}) cannot be reduced: only sum and avg partials are supported")


def _move_leading(b: Builder, y: fx.Node, n: int, shape: list[int], dim: int, phase: str) -> fx.Node:
    """(n*s0, s1, ...) holding n stacked chunks along dim 0 -> the chunks concatenated along `dim`."""
    if dim == 0:
        return y
    return _merge_leading(b, b.call(aten.view.default, (y, [n] + shape), phase=phase), n, shape, dim, phase)


def _split_to_leading(b: Builder, x: fx.Node, n: int, shape: list[int], dim: int, phase: str) -> fx.Node:
    """Split `dim` into n equal chunks and stack them along a new leading axis: (n, ..., s_dim/n, ...)."""
    if shape[dim] % n:
        raise CodegenError(f"dim {dim} of size {shape[dim]} does not split into {n} even chunks")
    split = shape[:dim] + [n, shape[dim] // n] + shape[dim + 1:]
    if dim == 0:
        return b.call(aten.reshape.default, (x, split), phase=phase)
    y = b.call(aten.reshape.default, (x, split), phase=phase)
    perm = [dim] + [i for i in range(len(split)) if i != dim]
    y = b.call(aten.permute.default, (y, perm), phase=phase)
    return b.call(aten.clone.default, (y,), {"memory_format": torch.contiguous_format}, phase=phase)


def _merge_leading(b: Builder, y: fx.Node, n: int, shape: list[int], dim: int, phase: str) -> fx.Node:
    """(n, *shape) -> leading axis merged into `dim` as its outer factor."""
    out = list(shape)
    out[dim] *= n
    if dim == 0:
        return b.call(aten.view.default, (y, out), phase=phase)
    k = len(shape)
    perm = list(range(1, dim + 1)) + [0] + list(range(dim + 1, k + 1))
    y = b.call(aten.permute.default, (y, perm), phase=phase)
    y = b.call(aten.clone.default, (y,), {"memory_format": torch.contiguous_format}, phase=phase)
    out = list(shape)
    out[dim] *= n
    return b.call(aten.view.default, (y, out), phase=phase)
