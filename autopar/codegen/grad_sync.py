"""Gradient synchronization of a lowered program: each parameter's gradient brought from the layout the backward
produces it in to its parameter's layout, data-parallel and FSDP reductions in buckets; and, for a step of
several microbatches, the `grad_sync` graph that does so once for the accumulated gradients."""
from __future__ import annotations

import re
from typing import Any

import torch.fx as fx

from autopar.codegen.builder import Builder
from autopar.codegen.collectives import bucketed_all_reduce, bucketed_reduce_scatter, checked_steps

# Gradient buckets as DDP's defaults: the first holds 1 MiB (so a reduction starts early in backward), the
# others 25 MiB.
BUCKET_BYTES = 25 * 2**20
FIRST_BUCKET_BYTES = 2**20

# Node meta of the nodes redistributing one gradient by itself (not in a bucket) whose first collective reduces
# it (in_turn): the parameter's FQN. codegen.partition issues such a gradient's collectives once the previous
# one's are done, as it does reduce-scatter buckets, so one full-size partial sum is in flight, not every one.
ALONE_GRAD = "autopar_alone_grad"


def in_turn(steps) -> bool:
    """Whether a gradient redistributed by itself in these steps takes turns (ALONE_GRAD): its first collective
    reads it as a full-size partial sum (a reduce-scatter or an all-reduce). One that is gathered first (a
    sharded gradient of a replicated weight) holds no more than its result: it is issued as it exists and
    waited on at the end of the backward."""
    first = next((st for st in steps if st.is_comm), None)
    return first is not None and first.kind in ("reduce_scatter", "all_reduce")


def sync_grads(low: Any, local: dict[str, fx.Node]) -> dict[str, fx.Node]:
    """Each gradient (`local`: fqn -> its local value in the layout it is produced in) brought to its
    parameter's layout, emitted by the lowering `low` (codegen.lower._Lowering) into its builder. Data-parallel
    (all-reduce, over one axis or several) and FSDP (reduce-scatter) gradients go in buckets, as DDP and FSDP
    do, not one collective each."""
    cap = low.cap
    grads: dict[str, fx.Node] = {}
    buckets: dict[tuple, list[tuple[str, fx.Node, int]]] = {}
    for fqn, value in local.items():
        g, pnode = cap.grads[fqn], cap.params[fqn]
        steps = checked_steps(low.layout_of(g), low.layout_of(pnode))
        axes = bucketed(steps)
        if axes is not None:
            key = (steps[0].kind, axes, value.meta["val"].dtype)
            buckets.setdefault(key, []).append((fqn, value, steps[0].dim))
        else:
            before = set(low.b.graph.nodes)
            grads[fqn] = low._redistribute(value, low.layout_of(g), low.layout_of(pnode), "bwd",
                                           f"the gradient of {fqn}")
            for n in low.b.graph.nodes if in_turn(steps) else ():
                if n not in before:
                    n.meta[ALONE_GRAD] = fqn
    for (kind, axis, _), items in buckets.items():
        # Gradients appear last layer first: fill buckets in that order so the first can start early.
        if kind == "all_reduce":
            grads.update(bucketed_all_reduce(low.b, [(f, x) for f, x, _ in items[::-1]], axis, low.rank,
                                             BUCKET_BYTES, FIRST_BUCKET_BYTES))
        else:
            grads.update(bucketed_reduce_scatter(low.b, items[::-1], axis, low.rank, BUCKET_BYTES))
    return grads


def grad_sync_graph(low: Any) -> fx.GraphModule:
    """(*accumulated gradients of `low.deferred`, in their produced layouts) -> (each in its parameter's
    layout): the gradient collectives of a step of several microbatches, run once after the last one."""
    low.b, low.cache = Builder(), {}
    local = {}
    for fqn in low.deferred:
        meta = low.env[low.cap.grads[fqn]].meta["val"]
        name = "grad_" + re.sub(r"[^0-9a-zA-Z_]", "_", fqn)
        local[fqn] = low.b.placeholder(name, tuple(meta.shape), meta.dtype)
    synced = sync_grads(low, local)
    low.b.output(tuple(synced[fqn] for fqn in low.deferred))
    return low.b.module()


def bucketed(steps) -> tuple[int, ...] | None:
    """For a gradient reduced in buckets, the axes (in mesh order) of its sum all-reduce or its sum
    reduce-scatter (steps[0].kind says which; over several axes, one collective over their flattened group);
    None for any other redistribution."""
    if len(steps) == 1 and steps[0].kind in ("all_reduce", "reduce_scatter") and steps[0].op == "sum":
        return steps[0].axes
    return None


__all__ = ["ALONE_GRAD", "in_turn", "BUCKET_BYTES", "FIRST_BUCKET_BYTES", "sync_grads", "grad_sync_graph", "bucketed"]
