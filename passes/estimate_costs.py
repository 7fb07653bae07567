"""Price every strategy: compute time per node, collective time per edge layout pair, memory per rank."""
from __future__ import annotations

import dataclasses
import functools
import math
import operator

import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate

from autopar.cost import collective_time, compute_time, link_spec, param_state_bytes, tensor_bytes
from autopar.passes import fp8_variants
from autopar.passes.context import PassContext
from autopar.redistribute import plan_steps
from autopar.rules.base import op_info

R = Replicate()


@dataclasses.dataclass
class EdgeCost:
    """Cost matrix of one edge over its distinct source and destination layouts."""

    src_layouts: list[tuple]
    dst_layouts: list[tuple]
    cost: list[list[float]]  # [src][dst], seconds, already multiplied by the edge count
    src_index: list[int]  # per source strategy: index into src_layouts
    dst_index: list[int] | None  # per destination strategy (None: fixed destination, the loss)
    # Gradient reductions: seconds on each mesh axis's links ({axis: [src][dst]}), for the overlap model.
    axis_cost: dict[int, list[list[float]]] | None = None


def estimate_costs_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    for key, strats in ctx.strategies.items():
        node = ctx.members[key][0]
        count = ctx.node_count[key]
        if node.op in ("placeholder", "get_attr"):
            ctx.compute_cost[key] = [_load_time(ctx, key, node, s) for s in strats]
            continue
        info = op_info(node)
        base = compute_time(info, ctx.hw)
        ctx.compute_cost[key] = [count * base / split_of(s, ctx.mesh.shape) for s in strats]
    fp8_variants.price_variants(ctx)
    _memory(ctx)
    ctx.edge_cost = [_edge_cost(ctx, e) for e in ctx.edges]
    ctx.edge_groups = _shared_redistributions(ctx)
    return gm


def _shared_redistributions(ctx: PassContext) -> list[int | None]:
    """Per edge, its group (None: alone). Edges carrying one value to several reads in one phase, alike in
    count, form a group: codegen redistributes a value once per (layout, phase), so the group pays each layout
    change once. Its edges get one list of destination layouts and one cost matrix."""
    cap = ctx.captured
    by_value: dict[tuple, list[int]] = {}
    for i, e in enumerate(ctx.edges):
        if e.kind not in ("activation", "param"):
            continue
        # A parameter-only value is recomputed in backward, so its gathers are counted per edge (count 2 for a
        # gather done again in backward) rather than per phase.
        phase = "" if e.kind == "param" else cap.phase[ctx.members[e.dst][0]]
        by_value.setdefault((e.src, e.out, e.kind, phase, e.count), []).append(i)
    groups: list[int | None] = [None] * len(ctx.edges)
    for gid, members in enumerate(m for m in by_value.values() if len(m) > 1):
        at: dict[tuple, int] = {}  # layout -> its index in the union (first seen first)
        for i in members:
            for lay in ctx.edge_cost[i].dst_layouts:
                at.setdefault(lay, len(at))
        union = list(at)
        first = ctx.edge_cost[members[0]]
        e = ctx.edges[members[0]]
        dtype = compute_dtype(e.meta.dtype, ctx)
        cost = _cost_matrix(ctx, e.meta.shape, dtype, first.src_layouts, union, False, e.count)
        for i in members:
            c = ctx.edge_cost[i]
            dst_index = [at[c.dst_layouts[j]] for j in c.dst_index]
            ctx.edge_cost[i] = EdgeCost(c.src_layouts, union, cost, c.src_index, dst_index)
            groups[i] = gid
    return groups


def _load_time(ctx: PassContext, key: str, node: fx.Node, strategy) -> float:
    """Per-step cost of a placeholder's layout. User inputs are copied host-to-device every step (each rank
    loads only its shard); parameters pay the optimizer step on their local shard (AdamW reads and writes
    param, grad and both moments: memory bound)."""
    if key.startswith("param/"):
        v = node.meta["val"]
        numel = math.prod(v.shape) // split_factor_shard(strategy.outs[0], ctx.mesh.shape)
        per_elem = 2 * (4 + 4 + ctx.precision.optimizer_state_bytes_per_param)
        return ctx.node_count[key] * numel * per_elem / ctx.hw.hbm_bandwidth
    if not key.startswith("input/"):
        return 0.0
    v = node.meta["val"]
    link = ctx.hw.links.get("pcie") or next(iter(ctx.hw.links.values()))
    return local_bytes(tuple(v.shape), v.dtype, strategy.outs[0], ctx.mesh.shape) / link.bandwidth


def split_of(strategy, sizes) -> int:
    """Ways the work of a node is divided: an axis divides it if it shards any input or output. (A Partial
    output alone does not: each rank then computes a full-size partial value.)"""
    from torch.distributed.tensor import Shard

    layouts = [lay for lay in strategy.ins if lay is not None] + list(strategy.outs)
    total = 1
    for a, n in enumerate(sizes):
        if any(isinstance(lay[a], Shard) for lay in layouts):
            total *= n
    return total


def compute_dtype(dtype: torch.dtype, ctx: PassContext) -> torch.dtype:
    """The dtype a value is priced in: its own. Under mixed precision the graph was captured under autocast
    (autopar.cost.resolve_precision), so it holds the casts: fp32 parameters, their bf16 copies, bf16 matmuls,
    fp32 gradients each carry the dtype they run in (and an FSDP gather of a cast copy moves half the bytes)."""
    return dtype


def local_bytes(shape, dtype, layout, sizes) -> int:
    n = math.prod(shape) if shape else 1
    return tensor_bytes((n // split_factor_shard(layout, sizes),), dtype)


def split_factor_shard(layout, sizes) -> int:
    from torch.distributed.tensor import Shard

    return math.prod(n for p, n in zip(layout, sizes) if isinstance(p, Shard))


def _memory(ctx: PassContext) -> None:
    """Persistent bytes (params, grads, optimizer state) and saved activation bytes, per strategy."""
    sizes = ctx.mesh.shape
    cap = ctx.captured
    param_keys = {ctx.key[n] for n in cap.params.values()}
    for key, strats in ctx.strategies.items():
        node = ctx.members[key][0]
        count = ctx.node_count[key]
        if key in param_keys:
            shape = tuple(node.meta["val"].shape)
            numel = math.prod(shape)
            trainable = cap.names[node].split("/", 1)[1] in cap.grads  # frozen: no grad, no optimizer state
            ctx.memory_cost[key] = [count * param_state_bytes(numel // split_factor_shard(s.outs[0], sizes),
                                                              ctx.precision, trainable) for s in strats]
    ctx.memory_cost.update(activation_memory(ctx))


def activation_memory(ctx: PassContext) -> dict[str, list[float]]:
    """Bytes of the activations backward keeps (ctx.saved), per key and strategy."""
    sizes = ctx.mesh.shape
    saved_outputs: dict[str, set[int]] = {}
    for key in ctx.saved:
        node = ctx.members[key][0]
        if node.op == "call_function" and node.target is operator.getitem:
            from autopar.passes.annotate_shapes import producer

            p, idx = producer(node)
            saved_outputs.setdefault(ctx.key[p], set()).add(idx)
        else:
            saved_outputs.setdefault(key, set()).add(0)
    param_keys = {ctx.key[n] for n in ctx.captured.params.values()}
    out = {}
    for key in ctx.strategies:
        if key in param_keys or key not in saved_outputs:
            continue
        node, count = ctx.members[key][0], ctx.node_count[key]
        metas = op_info(node).outputs
        out[key] = [count * sum(local_bytes(metas[i].shape, compute_dtype(metas[i].dtype, ctx), s.outs[i], sizes)
                                for i in saved_outputs[key] if i < len(metas) and metas[i] is not None)
                    for s in ctx.strategies[key]]
    return out


def _edge_cost(ctx: PassContext, e) -> EdgeCost:
    src_strats = ctx.strategies[e.src]
    src_at: dict[tuple, int] = {}  # layout -> its index in src_layouts (first seen first)
    src_index = [src_at.setdefault(s.outs[e.out], len(src_at)) for s in src_strats]
    src_layouts = list(src_at)
    if e.kind == "loss":
        dst_layouts, dst_index = [tuple(R for _ in ctx.mesh.shape)], None
    else:
        dst_index, at = [], {}
        for s in ctx.strategies[e.dst]:
            # A gradient or a buffer's new value goes to where its parameter or buffer is stored.
            lay = s.outs[0] if e.kind in ("grad", "buffer") else s.ins[e.arg]
            cls = (lay, fp8_variants.edge_class(ctx, e, s))  # an FP8 all-gather weight: its own class
            dst_index.append(at.setdefault(cls, len(at)))
        classes = list(at)
        dst_layouts = [lay for lay, _ in classes]
    dtype = {"grad": ctx.precision.grad_dtype, "buffer": e.meta.dtype}.get(e.kind) or compute_dtype(e.meta.dtype, ctx)
    # Gradient reductions travel in buckets (many gradients per collective): they pay bandwidth, not latency.
    grad = e.kind == "grad"
    cost = _cost_matrix(ctx, e.meta.shape, dtype, src_layouts, dst_layouts, grad, e.count)
    if e.kind != "loss" and any(c for _, c in classes):
        cost = [[fp8_variants.weight_edge_cost(ctx, e, a, b, row[j]) if classes[j][1] else row[j]
                 for j, b in enumerate(dst_layouts)] for a, row in zip(src_layouts, cost)]
    axis_cost = None
    if grad:
        axis_cost = {ax: [[0.0] * len(dst_layouts) for _ in src_layouts] for ax in range(len(ctx.mesh.shape))}
        for i, a in enumerate(src_layouts):
            for j, b in enumerate(dst_layouts):
                for ax, t in axis_times(ctx.hw, ctx.mesh, tuple(e.meta.shape), dtype, a, b).items():
                    axis_cost[ax][i][j] = e.count * t
    return EdgeCost(src_layouts, dst_layouts, cost, src_index, dst_index, axis_cost)


def axis_times(hw, mesh, shape, dtype, src, dst) -> dict[int, float]:
    """Seconds a bucketed gradient reduction holds each mesh axis's links (a collective over a flattened group
    holds all of its axes for its whole time)."""
    out: dict[int, float] = {}
    for st, t in step_costs(hw, mesh, tuple(shape), dtype, tuple(src), tuple(dst), True):
        if st.is_comm and t:
            for a in st.axes:
                out[a] = out.get(a, 0.0) + t
    return out


def _cost_matrix(ctx: PassContext, shape, dtype, srcs: list[tuple], dsts: list[tuple], grad: bool,
                 count: float) -> list[list[float]]:
    """count x transition_cost for every (source, destination) pair. Layouts are numbered once per context, so
    the pairs are looked up by small integers rather than by hashing their placements (most edges of a graph
    share shapes and layouts)."""
    ids, kinds, memo = ctx.layout_ids, ctx.transition_kinds, ctx.transition_memo
    kind = kinds.setdefault((tuple(shape), dtype, grad), len(kinds))
    src_ids = [ids.setdefault(a, len(ids)) for a in srcs]
    dst_ids = [ids.setdefault(b, len(ids)) for b in dsts]
    out = []
    for a, i in zip(srcs, src_ids):
        row = []
        for b, j in zip(dsts, dst_ids):
            t = memo.get((kind, i, j))
            if t is None:
                t = memo[(kind, i, j)] = transition_cost(ctx, shape, dtype, a, b, grad)
            row.append(count * t)
        out.append(row)
    return out


def transition_cost(ctx: PassContext, shape, dtype, src, dst, grad: bool = False) -> float:
    """Seconds to bring a value from layout `src` to `dst`; `grad`: a gradient reduced in buckets."""
    return _transition_cost(ctx.hw, ctx.mesh, tuple(shape), dtype, tuple(src), tuple(dst), grad)


@functools.lru_cache(maxsize=200_000)
def _transition_cost(hw, mesh, shape, dtype, src, dst, grad) -> float:
    return sum(t for _, t in step_costs(hw, mesh, shape, dtype, src, dst, grad))


@functools.lru_cache(maxsize=200_000)
def alone_rest(hw, mesh, shape, dtype, src, dst) -> float:
    """Seconds of a gradient's collectives after its first, where it is redistributed by itself rather than in a
    bucket and takes turns (a weight sharded over two axes: grad_sync.in_turn): codegen issues them once the next
    such gradient exists and waits for them there (codegen.partition), so the backward does not run beside
    them. 0 for any other."""
    from autopar.codegen.grad_sync import bucketed, in_turn

    steps = plan_steps(src, dst)
    if bucketed(steps) is not None or not in_turn(steps):
        return 0.0
    return sum([t for st, t in step_costs(hw, mesh, shape, dtype, src, dst, True) if st.is_comm][1:])


def _link(hw, kind: str, bucketed: bool):
    link = link_spec(hw, kind)
    return dataclasses.replace(link, latency=0.0) if bucketed else link


def step_link(hw, mesh, st, bucketed: bool = False):
    """The link a step's collective runs at: its axis's, or the slowest of a flattened group's axes (one ring
    over all their ranks)."""
    return min((_link(hw, mesh.links[a], bucketed) for a in st.axes), key=lambda lk: lk.bandwidth)


def step_costs(hw, mesh, shape, dtype, src, dst, bucketed: bool = False) -> list[tuple]:
    """[(Step, seconds)] for one layout change; bytes follow the local shape as the steps run."""
    from torch.distributed.tensor import Shard

    local = list(shape)
    for p, n in zip(src, mesh.shape):
        if isinstance(p, Shard):
            local[p.dim] //= n
    out = []
    for st in plan_steps(src, dst):
        n = st.ranks(mesh.shape)
        nbytes = tensor_bytes(tuple(local), dtype)
        t = 0.0
        link = step_link(hw, mesh, st, bucketed) if st.is_comm else None
        if st.kind == "all_gather":
            local[st.dim] *= n
            t = collective_time("all_gather", nbytes * n, n, link)
        elif st.kind == "reduce_scatter":
            t = collective_time("reduce_scatter", nbytes, n, link)
            local[st.dim] //= n
        elif st.kind == "all_reduce":
            t = collective_time("all_reduce", nbytes, n, link)
        elif st.kind == "all_to_all":
            t = collective_time("all_to_all", nbytes, n, link)
            local[st.dim] *= n
            local[st.dst_dim] //= n
        elif st.kind == "chunk":
            local[st.dim] //= n
        out.append((st, t))
    return out
