"""Split a local joint graph into a forward graph (params, buffers, inputs -> loss, saved tensors) and a
backward graph (saved tensors, tangents -> grads).

Forward values computed from parameters and buffers alone (a gathered weight, its transpose, a slice of a
buffer) are recomputed in the backward graph right before their first use instead of being saved: this is
the FSDP-style re-gather the planner priced, and it keeps a gathered weight alive only while it is used. So
are the values of recomputed regions (LocalJoint.recompute: the plan's recomputed layers and the model's
activation-checkpointed regions, autopar/recompute.py): their inputs are saved and the region runs again in
backward, collectives included (every rank recomputes the same ones). Random ops are never recomputed, so a
recomputed region reuses the forward's dropout masks.
"""
from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from autopar.codegen.grad_sync import ALONE_GRAD
from autopar.codegen.lower import GRAD_SYNC, LocalJoint
from autopar.codegen.schedule import issue_input_collectives_early, simplify
from autopar.recompute import random


@dataclasses.dataclass
class Split:
    """A local joint graph cut in two: forward (params, buffers, inputs[, rng_seed] -> loss, *saved) and backward
    (saved, tangents -> grads), and which forward values are saved or recomputed in backward."""

    forward: fx.GraphModule
    backward: fx.GraphModule
    saved: list[str]
    recomputed: list[str]


def _random(node: fx.Node) -> bool:
    return random(node)


def split(joint: LocalJoint) -> Split:
    graph = joint.gm.graph
    phase = joint.phase
    params, buffers = list(joint.params.values()), list(joint.buffers.values())
    constants = {n for n in graph.nodes if n.op == "get_attr"}
    persistent = set(params) | set(buffers) | constants
    tangents = set(joint.tangents)
    out_node = next(n for n in graph.nodes if n.op == "output")
    outs = list(out_node.args[0])
    n_tail = len(joint.updates) + joint.n_outputs + int(joint.count)
    heads, grads, tail = outs[:joint.n_heads], outs[joint.n_heads:len(outs) - n_tail], outs[len(outs) - n_tail:]

    recomputable: set[fx.Node] = set()
    param_only: set[fx.Node] = set()
    for n in graph.nodes:
        if n.op == "call_function" and phase[n] == "fwd" and not _random(n):
            # Values of parameters alone (a gathered weight), and every value of a recomputed region (the plan's
            # recomputed layers, the model's checkpointed regions), whose inputs are then saved in its place.
            # What a region's values feed outside it (a matmul under selective recomputation) stays saved.
            region = n in joint.recompute and not any(_random(a) for a in n.all_input_nodes)
            if all(a in persistent or a in param_only for a in n.all_input_nodes):
                param_only.add(n)
                recomputable.add(n)
            elif region and not (n.target is operator.getitem and n.args[0] not in recomputable):
                recomputable.add(n)

    def is_bwd(n: fx.Node) -> bool:
        return n in tangents or (n.op == "call_function" and phase[n] == "bwd")

    # Backward nodes the grads need, and the forward values they read.
    live_bwd = _ancestors([g for g in grads if g is not None], stop=lambda n: not is_bwd(n))
    saved: list[fx.Node] = []
    saved_set: set[fx.Node] = set()
    recompute: set[fx.Node] = set()

    def need(a: fx.Node) -> None:
        if is_bwd(a) or a in recompute or a in saved_set:
            return
        if a in recomputable or a in constants:
            recompute.add(a)
            for x in a.all_input_nodes:
                need(x)
        else:
            saved.append(a)
            saved_set.add(a)

    for n in graph.nodes:
        if n in live_bwd:
            for a in n.all_input_nodes:
                need(a)
    for g in grads:
        if g is not None and not is_bwd(g):
            need(g)
    order = {n: i for i, n in enumerate(graph.nodes)}
    saved.sort(key=order.__getitem__)

    fwd = _forward_graph(joint, heads, tail, saved)
    bwd = _backward_graph(joint, saved, recompute, live_bwd, grads)
    issue_input_collectives_early(fwd.graph, {n.name for n in joint.inputs})
    for gm in (fwd, bwd):
        simplify(gm.graph)
        gm.graph.lint()
        gm.recompile()
    return Split(fwd, bwd, [s.name for s in saved], sorted(n.name for n in recompute))


def _is_wait(n: fx.Node) -> bool:
    from autopar import _torch_compat as compat

    return compat.op_namespace_and_name(n.target) == ("_c10d_functional", "wait_tensor")


def _is_bucket_scatter(n: fx.Node) -> bool:
    from autopar import _torch_compat as compat
    from autopar.codegen.collectives import BUCKET_META

    return (n.meta.get(BUCKET_META) is not None
            and compat.op_namespace_and_name(n.target) == ("_c10d_functional", "reduce_scatter_tensor"))


def _ancestors(roots: list[fx.Node], stop) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = [r for r in roots if not stop(r)]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(a for a in n.all_input_nodes if not stop(a))
    return seen


def _copy(dst: fx.Graph, node: fx.Node, env: dict) -> fx.Node:
    new = dst.node_copy(node, lambda a: env[a])
    new.meta = dict(node.meta)
    env[node] = new
    return new


def _forward_graph(joint: LocalJoint, heads: list[fx.Node], tail: list[fx.Node],
                   saved: list[fx.Node]) -> fx.GraphModule:
    """(params, buffers, inputs, stage inputs[, seed]) -> (loss or a stage's activations, *tail, *saved): `tail`
    holds the buffers' new values, the other outputs and, with several microbatches, the loss's count."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    seed = [joint.rng_seed] if joint.rng_seed is not None else []
    for p in [*joint.params.values(), *joint.buffers.values(), *joint.inputs, *joint.stage_inputs, *seed]:
        _copy(g, p, env)
    live = _ancestors([*heads, *tail, *saved], stop=lambda n: n.op == "placeholder")
    for n in joint.gm.graph.nodes:
        if n in live and n.op in ("call_function", "get_attr"):
            _copy(g, n, env)
    g.output((*[env[h] for h in heads], *[env[u] for u in tail], *[env[s] for s in saved]))
    return fx.GraphModule(joint.gm, g)  # the joint module holds the constants get_attr nodes read


def _backward_graph(joint: LocalJoint, saved: list[fx.Node], recompute: set[fx.Node], live_bwd: set[fx.Node],
                    grads: list) -> fx.GraphModule:
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for s in saved:
        _copy(g, s, env) if s.op == "placeholder" else _as_placeholder(g, s, env)
    for t in joint.tangents:
        _copy(g, t, env)

    prefetch = _backward_prefetch(joint, recompute, live_bwd)

    def emit(n: fx.Node) -> None:
        # Recomputed forward values are emitted lazily, right before their first backward use. Waiting on a
        # bucket of parameter all-gathers so issues the bucket the backward needs next (prefetch, as FSDP does):
        # it runs while this layer computes, ahead of this layer's gradient reductions on the same axis.
        if n in env:
            return
        for a in n.all_input_nodes:
            emit(a)
        _copy(g, n, env)
        if _is_wait(n) and n.args[0] in prefetch:
            emit(prefetch[n.args[0]])

    # Gradient synchronization (the collectives taking each gradient to its parameter's layout) is issued
    # as soon as the gradient exists and waited on at the end, so it overlaps the rest of the backward. A
    # reduce-scatter bucket holds its full-size input until it is waited on, so it is waited on before the next
    # bucket is filled (as FSDP does): one bucket's input in flight, not every gradient at full size. A gradient
    # redistributed by itself whose first collective reduces it (ALONE_GRAD: a 2-D sharded parameter's,
    # reduce-scattered over one axis, then the other) holds its input likewise: its steps run to their end before
    # the next such gradient or a bucket is issued. (Not before the op computing the next one: which local op
    # that is can differ between ranks, and every rank must issue its collectives in one order.)
    sync = [n for n in joint.gm.graph.nodes if n in live_bwd and n.meta.get(GRAD_SYNC)]
    scatter_input = {n.args[0]: [u for u in n.users if _is_wait(u)] for n in sync if _is_bucket_scatter(n)}
    chain_end: dict[str, fx.Node] = {}  # fqn -> the last node of its gradient's redistribution
    for n in sync:
        if n.meta.get(ALONE_GRAD) is not None:
            chain_end[n.meta[ALONE_GRAD]] = n
    started: set[str] = set()
    in_flight: list[fx.Node] = []

    def rotate(then: list[fx.Node]) -> None:
        for w in in_flight:
            emit(w)
        in_flight[:] = then

    def issue_ready() -> None:
        progress = True
        while progress:
            progress = False
            for n in list(sync):
                if n in env:  # emitted with a gradient redistributed by itself
                    sync.remove(n)
                    continue
                if _is_wait(n) or not all(a in env for a in n.all_input_nodes):
                    continue
                if n in scatter_input:
                    rotate(scatter_input[n])
                elif n.meta.get(ALONE_GRAD) is not None and n.meta[ALONE_GRAD] not in started:
                    started.add(n.meta[ALONE_GRAD])  # the first node of its chain
                    rotate([chain_end[n.meta[ALONE_GRAD]]])
                emit(n)
                sync.remove(n)
                progress = True

    for n in joint.gm.graph.nodes:
        if n in live_bwd and n.op == "call_function" and not n.meta.get(GRAD_SYNC):
            for a in n.all_input_nodes:
                if a in recompute:
                    emit(a)
            emit(n)
            if sync:
                issue_ready()
    for n in sync:
        emit(n)
    for gr in grads:
        if gr is not None and gr not in env:
            emit(gr)
    g.output(tuple(env[gr] if gr is not None else None for gr in grads))
    return fx.GraphModule(joint.gm, g)


def _backward_prefetch(joint: LocalJoint, recompute: set[fx.Node], live_bwd: set[fx.Node]) -> dict[fx.Node, fx.Node]:
    """Each parameter all-gather bucket the backward gathers again -> the one it gathers next (in the order the
    backward first needs them)."""
    from autopar.codegen.collectives import BUCKET_META

    order: list[fx.Node] = []
    seen: set[fx.Node] = set()

    def visit(n: fx.Node) -> None:
        if n in seen or n not in recompute:
            return
        seen.add(n)
        for a in n.all_input_nodes:
            visit(a)
        if n.meta.get(BUCKET_META) is not None:
            order.append(n)

    for n in joint.gm.graph.nodes:
        if n in live_bwd and n.op == "call_function" and not n.meta.get(GRAD_SYNC):
            for a in n.all_input_nodes:
                visit(a)
    return dict(zip(order, order[1:]))


def _as_placeholder(g: fx.Graph, node: fx.Node, env: dict) -> fx.Node:
    new = g.placeholder(node.name)
    new.meta = {"val": node.meta.get("val")}
    env[node] = new
    return new
