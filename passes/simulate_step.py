"""Simulate one training step under the chosen strategies: compute and communication streams with overlap,
and peak memory from tensor liveness over the schedule."""
from __future__ import annotations

import collections
import dataclasses
import math
import operator

import torch
import torch.fx as fx

from autopar.cost import VIEW_OPS, tensor_bytes
from autopar.passes.annotate_shapes import _scale, producer
from autopar.passes.context import PassContext
from autopar.passes.estimate_costs import compute_dtype, local_bytes, step_costs
from autopar.rules.base import flat_tensor_args, op_info


@dataclasses.dataclass
class Simulation:
    step_time: float
    compute_time: float
    comm_time: float
    exposed_comm: float
    optimizer_time: float
    peak_memory: int
    memory: dict[str, int]
    comm_by_axis: dict[str, float]
    comm_bytes_by_axis: dict[str, float]
    node_time: dict[str, float]
    top_ops: list[tuple[str, float]]
    timeline: list[tuple[str, str, float, float]]  # (stream, label, start, end), a sample for plots


def simulate_step_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    ctx.simulation = simulate(ctx)
    return gm


def _out_layout(ctx: PassContext, node: fx.Node) -> tuple:
    u, idx = producer(node)
    return ctx.chosen(ctx.key[u]).outs[idx]


def simulate(ctx: PassContext) -> Simulation:
    cap, mesh, hw = ctx.captured, ctx.mesh, ctx.hw
    gm = cap.gm
    compute_free = 0.0
    ready: dict[fx.Node, float] = {}
    total_compute = total_comm = 0.0
    comm_axis: dict[str, float] = collections.defaultdict(float)
    comm_bytes: dict[str, float] = collections.defaultdict(float)
    node_time: dict[str, float] = collections.defaultdict(float)
    timeline = []
    grad_nodes: dict[fx.Node, list[tuple[str, int]]] = collections.defaultdict(list)
    for fqn, g in cap.grads.items():
        u, idx = producer(g)
        grad_nodes[u].append((fqn, idx))

    axis_free = [0.0] * len(mesh.shape)  # one stream per mesh axis: each axis has its own links
    m = ctx.microbatches
    deferred: list[tuple] = []

    def comm(shape, dtype, src, dst, start, scale, label, bucketed=False):
        nonlocal total_comm
        t = start
        for st, c in step_costs(hw, mesh, tuple(shape), dtype, tuple(src), tuple(dst), bucketed):
            if not st.is_comm or c == 0:
                continue
            c *= scale
            ax = mesh.axis_names[st.axis]
            comm_axis[f"{ax}:{st.kind}"] += c
            comm_bytes[ax] += tensor_bytes(tuple(shape), dtype) * scale / max(1, _shard(src, mesh.shape))
            begin = max(axis_free[st.axis], t)
            t = axis_free[st.axis] = begin + c
            total_comm += c
            if len(timeline) < 4000:
                timeline.append((f"comm:{ax}", label, begin, t))
        return t

    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            ready[node] = 0.0
            continue
        if node.op != "call_function":
            continue
        if node.target is operator.getitem:
            ready[node] = ready[node.args[0]]
            continue
        key = ctx.key[node]
        strat = ctx.chosen(key)
        scale = _scale(ctx, node)[1]
        info = op_info(node)
        args = [a for a in flat_tensor_args(node.args, node.kwargs)
                if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]
        t_in = 0.0
        for i, a in enumerate(args):
            src = _out_layout(ctx, a)
            dst = strat.ins[i]
            u = producer(a)[0]
            regather = 2 if u.op == "placeholder" and node in ctx.param_derived else 1
            arrive = comm(info.inputs[i].shape, compute_dtype(info.inputs[i].dtype, ctx), src, dst, ready[a],
                          scale * regather, ctx.captured.names[node])
            t_in = max(t_in, arrive)
        dur = ctx.compute_cost[key][ctx.choice[key]] / ctx.node_count[key] * scale
        start = max(compute_free, t_in)
        compute_free = start + dur
        total_compute += dur
        node_time[key] += dur
        ready[node] = compute_free
        if dur > 0 and len(timeline) < 4000:
            timeline.append(("compute", ctx.captured.names[node], start, compute_free))
        for fqn, idx in grad_nodes.get(node, ()):
            pkey = ctx.key[cap.params[fqn]]
            meta = node.meta["val"]
            val = meta[idx] if isinstance(meta, (list, tuple)) else meta
            grad = (tuple(val.shape), ctx.precision.grad_dtype, strat.outs[idx], ctx.chosen(pkey).outs[0])
            if m > 1:  # reduced once per step, after the last microbatch (codegen's grad_sync graph)
                deferred.append((grad, _scale(ctx, cap.params[fqn])[1], f"grad {fqn}"))
                continue
            comm(*grad, compute_free, _scale(ctx, cap.params[fqn])[1], f"grad {fqn}", bucketed=True)
    opt = _optimizer_time(ctx)
    step = max([compute_free] + axis_free) + opt
    if m > 1:
        # m microbatches back to back, then the gradient reductions, then the optimizer step.
        span = step - opt
        total_compute, total_comm = m * total_compute, m * total_comm
        for table in (comm_axis, comm_bytes, node_time):
            for k in table:
                table[k] *= m
        for grad, scale, label in deferred:
            comm(*grad, span, scale, label, bucketed=True)
        step = (m - 1) * span + max([span] + axis_free) + opt
    memory, peak = _memory(ctx)
    top = sorted(node_time.items(), key=lambda kv: -kv[1])[:15]
    return Simulation(step_time=step, compute_time=total_compute, comm_time=total_comm,
                      exposed_comm=max(0.0, step - opt - total_compute), optimizer_time=opt, peak_memory=peak,
                      memory=memory, comm_by_axis=dict(comm_axis), comm_bytes_by_axis=dict(comm_bytes),
                      node_time=dict(node_time), top_ops=top, timeline=timeline)


def _shard(layout, sizes) -> int:
    from torch.distributed.tensor import Shard

    return math.prod(n for p, n in zip(layout, sizes) if isinstance(p, Shard))


def _param_local_numel(ctx: PassContext, trainable_only: bool = False) -> float:
    """Parameter elements this rank stores (only those with a gradient: trainable_only)."""
    total = 0.0
    for fqn, node in ctx.captured.params.items():
        if trainable_only and fqn not in ctx.captured.grads:
            continue
        lay = ctx.chosen(ctx.key[node]).outs[0]
        total += math.prod(node.meta["val"].shape) / _shard(lay, ctx.mesh.shape) * _scale(ctx, node)[1]
    return total


def _optimizer_time(ctx: PassContext) -> float:
    # AdamW reads and writes param, grad and both moments of each trainable parameter: memory bound.
    numel = _param_local_numel(ctx, trainable_only=True)
    per_elem = 2 * (4 + 4 + ctx.precision.optimizer_state_bytes_per_param)
    return numel * per_elem / ctx.hw.hbm_bandwidth


def _memory(ctx: PassContext) -> tuple[dict[str, int], int]:
    p = ctx.precision
    numel = _param_local_numel(ctx)
    trained = _param_local_numel(ctx, trainable_only=True)  # frozen parameters have no grad or optimizer state
    param_b = numel * torch.tensor([], dtype=p.param_dtype).element_size()
    grad_b = trained * torch.tensor([], dtype=p.grad_dtype).element_size()
    opt_b = trained * p.optimizer_state_bytes_per_param
    master = trained * 4 if getattr(p, "master_weights", False) and p.param_dtype != torch.float32 else 0
    accumulation = _accumulation_bytes(ctx) if ctx.microbatches > 1 else 0
    static = param_b + grad_b + opt_b + master + accumulation
    peak = _activation_peak(ctx)
    mem = {"params": int(param_b), "grads": int(grad_b), "optimizer": int(opt_b), "master_weights": int(master),
           "activations": int(peak)}
    if ctx.pipeline is not None:  # one pipeline rank's share (passes/split_stages.py)
        from autopar.passes.split_stages import stage_memory

        return stage_memory(ctx, mem, peak)
    if accumulation:
        mem["grad_accumulation"] = int(accumulation)
    return mem, int(static + peak)


def _accumulation_bytes(ctx: PassContext) -> float:
    """Gradients accumulate over microbatches in the layout they are produced in and are reduced once per step
    into the gradient buffers (counted under "grads"), which are empty until then (zero_grad sets them to
    None): what a produced layout holds beyond its parameter's (a full-size Partial gradient of an FSDP shard)
    is the extra."""
    total = 0.0
    for fqn, g in ctx.captured.grads.items():
        u, idx = producer(g)
        pnode = ctx.captured.params[fqn]
        lay, plain = ctx.chosen(ctx.key[u]).outs[idx], ctx.chosen(ctx.key[pnode]).outs[0]
        shape, dtype = tuple(pnode.meta["val"].shape), ctx.precision.grad_dtype
        extra = local_bytes(shape, dtype, lay, ctx.mesh.shape) - local_bytes(shape, dtype, plain, ctx.mesh.shape)
        total += max(0, extra) * _scale(ctx, pnode)[1]
    return total


def _owners(nodes: list[fx.Node]) -> dict[fx.Node, fx.Node | None]:
    """Per compute node, the node whose allocation holds its value: itself, or for a view (and a tuple getitem)
    the owner of what it views, as the ILP's saved-activation estimate counts a saved view's base once; None
    for a view of a graph input (a parameter's transpose), which holds no activation memory."""
    owner: dict[fx.Node, fx.Node | None] = {}
    for n in nodes:
        if n.op != "call_function":
            continue
        if n.target is operator.getitem or (getattr(n.target, "overloadpacket", None) in VIEW_OPS
                                            and n.all_input_nodes):
            a = n.args[0] if n.target is operator.getitem else n.all_input_nodes[0]
            owner[n] = owner.get(a) if a.op == "call_function" else None
        else:
            owner[n] = n
    return owner


def _activation_peak(ctx: PassContext) -> float:
    """Peak bytes of activations on one rank over the step, from the liveness of each allocation.

    An allocation lives from its node to its last reader (through views of it); gradients handed to the
    output are reduced into the persistent grad buffers at once. Values computed only from parameters (a
    gathered or cast weight), and the values of the model's activation-checkpointed regions, are recomputed in
    backward rather than kept, as codegen's partition does: they live during their forward uses and again
    during their backward uses. In a template capture (k of L layers
    traced) a layer's value kept from forward into backward stands for L/k layers' copies, as its costs do;
    values used up within the forward or within the backward are transient and count once."""
    cap = ctx.captured
    nodes = list(cap.gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    owner = _owners(nodes)
    uses: dict[fx.Node, list[int]] = collections.defaultdict(list)
    for u in nodes:
        if u.op != "call_function":
            continue
        for a in u.all_input_nodes:
            o = owner.get(a)
            if o is not None:
                uses[o].append(pos[u])
    alloc = [0.0] * (len(nodes) + 1)
    free = [0.0] * (len(nodes) + 1)
    for o in set(owner.values()) - {None}:
        fwd = [i for i in uses[o] if cap.phase[nodes[i]] == "fwd"]
        bwd = [i for i in uses[o] if cap.phase[nodes[i]] == "bwd"]
        b = _node_bytes(ctx, o)
        if (o in ctx.param_derived or o in ctx.recomputed) and cap.phase[o] == "fwd":
            spans = ([(pos[o], max(fwd))] if fwd else []) + ([(min(bwd), max(bwd))] if bwd else [])
        else:
            if cap.phase[o] == "fwd" and bwd:
                b *= _scale(ctx, o)[1]
            spans = [(pos[o], max(uses[o], default=pos[o]))]
        for lo, hi in spans:
            alloc[lo] += b
            free[hi] += b
    cur = peak = 0.0
    for i in range(len(nodes)):
        cur += alloc[i]
        peak = max(peak, cur)
        cur -= free[i]
    return peak


def _node_bytes(ctx: PassContext, n: fx.Node) -> float:
    """Bytes of a node's outputs on one rank, in their planned layouts."""
    strat = ctx.chosen(ctx.key[n])
    val = n.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else [val]
    total = 0.0
    for i, v in enumerate(vals):
        if isinstance(v, torch.Tensor) and i < len(strat.outs):
            total += local_bytes(tuple(v.shape), compute_dtype(v.dtype, ctx), strat.outs[i], ctx.mesh.shape)
    return total
