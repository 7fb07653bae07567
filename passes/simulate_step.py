"""Simulate one training step under the chosen strategies: compute and communication streams with overlap,
and peak memory from tensor liveness over the schedule."""
from __future__ import annotations

import collections
import dataclasses
import math
import operator

import torch
import torch.fx as fx

from autopar.cost import tensor_bytes
from autopar.layout import transpose_layout
from autopar.passes.annotate_shapes import _scale, producer
from autopar.passes.context import PassContext
from autopar.codegen.grad_sync import in_turn
from autopar.passes.estimate_costs import compute_dtype, local_bytes, step_costs
from autopar.passes.memory_profile import buffer_bytes, input_bytes, memory_profile
from autopar.redistribute import plan_steps
from autopar.rules.base import flat_tensor_args, op_info
from autopar.strategy import FP8_TENSORWISE_AG


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
    # Per mesh axis: seconds blocking collectives (layout changes, not gradient reductions) waited for the axis.
    waits_by_axis: dict[int, float] = dataclasses.field(default_factory=dict)


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
    waited = [0.0] * len(mesh.shape)
    moved: dict[tuple, float] = {}  # (value, layout, phase) -> when the redistributed copy is ready
    m = ctx.microbatches
    deferred: list[tuple] = []
    rerun: set[fx.Node] = set()
    gathers = _param_gathers(ctx)
    persistent = set(cap.params.values()) | set(cap.buffers.values())
    gathered: dict[tuple[int, str], list[float]] = {}  # (group, phase) -> when each member is there
    alone = None  # the gradient redistributed by itself in flight: (its redistribution, first step's end, ...)

    def gather(idx: int, phase: str, start: float, blocking: bool = True) -> list[float]:
        """Issue group `idx` of parameter gathers (a bucket of one layer's all-gathers, or one gather on its own)
        at `start`, once per phase; returns when each member's part is done."""
        if (idx, phase) not in gathered:
            gathered[(idx, phase)] = [comm(shape, dtype, src, dst, start, scale, label, blocking=blocking)
                                      for shape, dtype, src, dst, scale, label in gathers.groups[idx].comms]
        return gathered[(idx, phase)]

    def recompute_moves(again: list[fx.Node], start: float) -> float:
        """A recomputed region runs again with its collectives (codegen): the layout changes of the activations
        (and inputs) its ops read, once per value and layout, ready before it computes. Parameters are gathered
        for the backward in any case."""
        done = start
        for n in again:
            strat, info, scale = ctx.chosen(ctx.key[n]), op_info(n), _scale(ctx, n)[1]
            for i, a in enumerate(_tensor_args(n)):
                u = producer(a)[0]
                if u in persistent or u in ctx.param_derived:
                    continue
                dtype = compute_dtype(info.inputs[i].dtype, ctx)
                key = (a, tuple(strat.ins[i]), dtype, "recompute")
                if key not in moved:
                    moved[key] = comm(info.inputs[i].shape, dtype, _out_layout(ctx, a), strat.ins[i], start, scale,
                                      f"recompute {ctx.captured.names[n]}")
                done = max(done, moved[key])
        return done

    def comm(shape, dtype, src, dst, start, scale, label, bucketed=False, blocking=True, part=None):
        """Schedule a redistribution's collectives from `start`: when the last ends. `part` "first" or "rest":
        its first collective only, or the others."""
        nonlocal total_comm
        t = start
        steps = [(st, c) for st, c in step_costs(hw, mesh, tuple(shape), dtype, tuple(src), tuple(dst), bucketed)
                 if st.is_comm]
        steps = steps[:1] if part == "first" else steps[1:] if part == "rest" else steps
        for st, c in steps:
            if c == 0:
                continue
            c *= scale
            # One over a flattened group holds all of its axes' links.
            ax = "+".join(mesh.axis_names[a] for a in st.axes)
            comm_axis[f"{ax}:{st.kind}"] += c
            for a in st.axes:
                comm_bytes[mesh.axis_names[a]] += tensor_bytes(tuple(shape), dtype) * scale / max(
                    1, _shard(src, mesh.shape))
            begin = max([t] + [axis_free[a] for a in st.axes])
            if not bucketed and blocking:
                waited[st.axis] += begin - t
            t = begin + c
            for a in st.axes:
                axis_free[a] = t
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
        args = _tensor_args(node)
        t_in = 0.0
        for i, a in enumerate(args):
            dtype = compute_dtype(info.inputs[i].dtype, ctx)
            if strat.variant == FP8_TENSORWISE_AG and getattr(ctx.fp8_sites.get(key), "weight", None) == i:
                dtype = torch.float8_e4m3fn  # the weight is gathered as its FP8 cast (passes/fp8_variants.py)
            member = gathers.reads.get((node, i))
            if member is not None and cap.phase[node] == "fwd":
                # Codegen issues the next bucket when it waits on this one (prefetch): it gathers while this
                # layer computes, and the first at its first use. An op waits for its own parameter's part (the
                # bucket's whole wait matters for the first layer alone, and a template's captured layer stands
                # for many).
                idx, j = member
                t_in = max(t_in, gather(idx, "fwd", compute_free)[j])
                nxt = gathers.next_bucket.get(idx)
                if nxt is not None:
                    gather(nxt, "fwd", compute_free, blocking=False)
                continue
            # In the backward, a gathered weight is gathered again (codegen recomputes parameter-only values
            # rather than saving them): its whole bucket, at the first backward use, which issues the bucket
            # the backward needs next (prefetch).
            again = [member[0]] if member is not None else gathers.again.get(producer(a)[0], ())
            for idx in again if cap.phase[node] == "bwd" else ():
                t_in = max(t_in, max(gather(idx, "bwd", compute_free)))
                again_fwd = gathers.groups[idx].phase == "fwd"
                nxt = gathers.next_backward.get(idx) if again_fwd else gathers.next_bucket.get(idx)
                if nxt is not None:
                    gather(nxt, "bwd", compute_free, blocking=False)
            if member is not None:
                continue
            # Codegen redistributes a value once per layout, dtype and phase, however many ops read it so.
            moved_key = (a, tuple(strat.ins[i]), dtype, cap.phase[node])
            if moved_key not in moved:
                moved[moved_key] = comm(info.inputs[i].shape, dtype, _out_layout(ctx, a), strat.ins[i], ready[a],
                                        scale, ctx.captured.names[node])
            t_in = max(t_in, moved[moved_key])
        if cap.phase[node] == "bwd" and ctx.recomputed:
            # Recomputed forward values are computed again right before the first backward op reading them.
            again = _to_recompute(ctx, node, rerun)
            if again:
                t = sum(_duration(ctx, n) for n in again)
                begin = max(compute_free, t_in, recompute_moves(again, max(compute_free, t_in)))
                compute_free = begin + t
                total_compute += t
                node_time["recompute"] += t
                if len(timeline) < 4000:
                    timeline.append(("compute", f"recompute {ctx.captured.names[again[0]]} ...", begin, compute_free))
        dur = _duration(ctx, node)
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
            gscale = _scale(ctx, cap.params[fqn])[1]
            if grad_reduction(ctx, grad[2], grad[3], cap.params[fqn])[0] != ALONE or not in_turn(
                    plan_steps(tuple(grad[2]), tuple(grad[3]))):
                comm(*grad, compute_free, gscale, f"grad {fqn}", bucketed=True)
                continue
            # Redistributed by itself (codegen.partition): the previous such gradient's collectives are waited
            # on, the rest of them issued and waited on, before this one's first is issued.
            if alone is not None:
                compute_free = max(compute_free, comm(*alone[0], max(alone[1], compute_free), alone[2],
                                                      alone[3], bucketed=True, part="rest"), alone[1])
            alone = (grad, comm(*grad, compute_free, gscale, f"grad {fqn}", bucketed=True, part="first"),
                     gscale, f"grad {fqn}")
    if alone is not None:  # the last one's other collectives, issued at the end of the backward
        comm(*alone[0], max(alone[1], compute_free), alone[2], alone[3], bucketed=True, part="rest")
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
                      node_time=dict(node_time), top_ops=top, timeline=timeline,
                      waits_by_axis={a: m * w for a, w in enumerate(waited) if w})


@dataclasses.dataclass
class GatherGroup:
    """Parameter gathers codegen issues as one: a bucket (codegen.lower._plan_gather_buckets), or one gather."""

    phase: str  # of the first use
    bucket: bool
    comms: list[tuple]  # (shape, dtype, src, dst, scale, label) per member, in codegen's order


@dataclasses.dataclass
class ParamGathers:
    groups: list[GatherGroup]
    reads: dict[tuple[fx.Node, int], tuple[int, int]]  # (node, input slot) -> (group, member)
    next_bucket: dict[int, int]  # bucket -> the bucket of its phase codegen issues when it waits on this one
    again: dict[fx.Node, list[int]]  # forward parameter-only value -> groups gathered in computing it
    next_backward: dict[int, int]  # forward bucket -> the one the backward gathers again next


def _param_gathers(ctx: PassContext) -> ParamGathers:
    """The layout changes of parameters and of values computed from them alone, grouped as codegen issues them.
    A parameter, its dtype cast or a 2-D transpose of either, gathered in one all-gather step, joins the bucket
    of its layer, mesh axis and dtype (outside the layers, only the bucket just before it), in order of first
    use; other such changes, and a bucket of one, go on their own. In the forward the next bucket is issued when
    this one is waited on; values computed from parameters alone are computed again in the backward, their
    gathers with them, so `again` says which groups a backward read of such a value gathers."""
    cap = ctx.captured
    params = set(cap.params.values()) | set(cap.buffers.values())
    runs: list[tuple[tuple | None, str, list[tuple]]] = []  # (bucket group or None, phase, comms)
    last: int | None = None  # the last bucket run
    where: dict[tuple, tuple[int, int]] = {}  # member -> (run, place)
    reads: dict[tuple[fx.Node, int], tuple] = {}
    needs: dict[fx.Node, set] = {}
    for node in cap.gm.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        strat, info = ctx.chosen(ctx.key[node]), op_info(node)
        args = _tensor_args(node)
        own: set = set()
        for i, a in enumerate(args):
            u = producer(a)[0]
            if node in ctx.param_derived and cap.phase[node] == "fwd":
                own |= needs.get(u, set())
            if (u not in params and u not in ctx.param_derived) or strat.ins[i] is None:
                continue
            if strat.variant == FP8_TENSORWISE_AG and getattr(ctx.fp8_sites.get(ctx.key[node]), "weight", None) == i:
                continue  # gathered in FP8 on its own (codegen/fp8.py)
            src, dst = _out_layout(ctx, a), tuple(strat.ins[i])
            steps = [st for st in plan_steps(src, dst) if st.is_comm]
            if not steps:
                continue
            dtype = compute_dtype(info.inputs[i].dtype, ctx)
            base = _gathered_param(ctx, a)
            one = base is not None and len(steps) == 1 and steps[0].kind == "all_gather"
            param = base[0] if one else None
            member = (param, transpose_layout(dst) if base[1] else dst, dtype) if one else (a, dst, dtype)
            reads[(node, i)] = member
            own.add(member)
            if member in where:
                continue
            group = (cap.layer_of(cap.names[param].split("/", 1)[1]), steps[0].axes, dtype,
                     cap.phase[node]) if one else None
            run = None
            if group is not None and group[0]:
                run = next((r for r, (g, _, _) in enumerate(runs) if g == group), None)
            if run is None and group is not None and last is not None and runs[last][0] == group:
                run = last
            if run is None:
                runs.append((group, cap.phase[node], []))
                run = len(runs) - 1
            if group is not None:
                last = run
            where[member] = (run, len(runs[run][2]))
            runs[run][2].append((tuple(info.inputs[i].shape), dtype, src, dst, _scale(ctx, node)[1],
                                 f"gather {cap.names[param if one else node]}"))
        if node in ctx.param_derived and cap.phase[node] == "fwd":
            needs[node] = own
    groups = [GatherGroup(phase, group is not None and len(comms) > 1, comms) for group, phase, comms in runs]
    buckets = [i for i, g in enumerate(groups) if g.bucket]
    nxt = {i: j for i, j in zip(buckets, buckets[1:]) if groups[i].phase == groups[j].phase}
    again = {n: sorted({where[m][0] for m in ms}) for n, ms in needs.items() if ms}
    order: list[int] = []
    for node in cap.gm.graph.nodes:
        if node.op != "call_function" or cap.phase.get(node) != "bwd":
            continue
        args = _tensor_args(node)
        for i, a in enumerate(args):
            for g in ([where[reads[(node, i)]][0]] if (node, i) in reads else again.get(producer(a)[0], ())):
                if groups[g].bucket and groups[g].phase == "fwd" and g not in order:
                    order.append(g)
    return ParamGathers(groups, {k: where[m] for k, m in reads.items()}, nxt, again, dict(zip(order, order[1:])))


def _gathered_param(ctx: PassContext, a: fx.Node) -> tuple[fx.Node, bool] | None:
    """(param, odd) when `a` is a parameter, a dtype cast of one made in its own layout, or a chain of 2-D
    transposes of either, each reading its input as laid out (odd: an odd number of them), as
    codegen.lower._param_view takes them; else None."""
    params = set(ctx.captured.params.values())
    a, odd = producer(a)[0], False
    while a not in params:
        if a.op != "call_function" or a not in ctx.param_derived or not a.args or not isinstance(a.args[0], fx.Node):
            return None
        inner = producer(a.args[0])[0]
        lay = tuple(_out_layout(ctx, inner))
        ins = tuple(ctx.chosen(ctx.key[a]).ins[0] or ())
        if a.target is torch.ops.aten.t.default and a.meta["val"].dim() == 2:
            if ins != lay or _out_layout(ctx, a) != transpose_layout(lay):
                return None
            a, odd = inner, not odd
        elif a.target is torch.ops.aten._to_copy.default and len(a.args) == 1 and set(a.kwargs) <= {"dtype"} \
                and inner in params and ins == lay == _out_layout(ctx, a):
            a = inner
        else:
            return None
    return a, odd


def _tensor_args(node: fx.Node) -> list[fx.Node]:
    return [a for a in flat_tensor_args(node.args, node.kwargs)
            if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]


def _duration(ctx: PassContext, node: fx.Node) -> float:
    key = ctx.key[node]
    return ctx.compute_cost[key][ctx.choice[key]] / ctx.node_count[key] * _scale(ctx, node)[1]


def _to_recompute(ctx: PassContext, node: fx.Node, done: set[fx.Node]) -> list[fx.Node]:
    """The recomputed forward nodes a backward node needs that backward has not recomputed yet, in order (marked
    done). Parameter-only values (recomputed in any case, priced with their gathers) are left out."""
    out: list[fx.Node] = []

    def need(n: fx.Node) -> None:
        if n in done or n not in ctx.recomputed or n in ctx.param_derived:
            return
        done.add(n)
        for a in n.all_input_nodes:
            need(a)
        if n.target is not operator.getitem:
            out.append(n)

    for a in node.all_input_nodes:
        need(a)
    return out


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
    accumulation = accumulation_bytes(ctx) if ctx.microbatches > 1 else 0
    buckets = grad_bucket_bytes(ctx)
    prof = memory_profile(ctx)
    _, peak, point = prof.peak(ctx.choice)
    live_grads = prof.gradients_at(ctx.choice, point)
    copies = prof.copies_at(ctx.choice, point)
    if prof.term_key:  # the gradients live where the backward produces them (passes/memory_profile.py), but
        # those whose allocation the profile did not find
        grad_b = sum(float(v[ctx.choice[k]]) for k, v in prof.static_grads.items())
    buffers = sum(float(b[ctx.choice[k]]) for k, b in buffer_bytes(ctx).items())
    inputs = sum(float(b[ctx.choice[k]]) for k, b in input_bytes(ctx).items())
    static = param_b + buffers + inputs + grad_b + opt_b + master + accumulation + buckets
    mem = {"params": int(param_b), "buffers": int(buffers), "grads": int(grad_b + live_grads), "optimizer": int(opt_b),
           "master_weights": int(master), "activations": int(peak - live_grads - copies)}
    if inputs:
        mem["inputs"] = int(inputs)
    if copies:
        mem["copies"] = int(copies)
    if ctx.pipeline is not None:  # one pipeline rank's share (passes/split_stages.py)
        from autopar.passes.split_stages import stage_memory

        return stage_memory(ctx, mem, peak)
    if accumulation:
        mem["grad_accumulation"] = int(accumulation)
    if buckets:
        mem["grad_buckets"] = int(buckets)
    return mem, int(static + peak)


def grad_bucket_bytes(ctx: PassContext) -> float:
    """Gradient collective buffers of the backward, beyond the gradients in their parameters' layouts: the largest
    gradient bucket (autopar/codegen/grad_sync.py: a bucket's gradients are copied into one flat buffer once the
    last of them exists, and while it is written both copies live; buckets filled as codegen fills them, per
    kind of reduction, the last parameters' gradients first, 1 MiB for the first bucket, 25 MiB for the others;
    a reduce-scatter bucket's gradients are larger than the shards they become, and its input lives until it is
    waited on, before the next bucket is written), or the largest of the produced gradients redistributed one
    by one (a 2-D sharded parameter's: issued as soon as it exists, its collectives done before the next such
    gradient or reduce-scatter bucket is issued, codegen.partition; alone_held), and those gathered first (a
    sharded gradient of a replicated weight: waited on at the end of the backward, so all live until then). Where the memory profile
    counts the reduced gradients from where they are produced (passes/memory_profile.py), that is what the
    bucket holds beyond them."""
    from autopar.codegen.grad_sync import BUCKET_BYTES, FIRST_BUCKET_BYTES
    from autopar.passes.memory_profile import produced_gradients

    if ctx.microbatches > 1:  # reduced once per step from the accumulated gradients (counted apart)
        return 0.0
    produced = produced_gradients(ctx)
    kinds: dict[tuple, list[tuple[float, float]]] = {}
    alone = 0.0  # the largest gradient in flight by itself, taking turns
    gathered = 0.0  # gradients redistributed by themselves, gathered first: to the end of the backward
    # Gradients appear last layer first; a captured layer standing for several repeats as a whole, in order.
    runs: list[tuple[str, int, list[tuple]]] = []  # (layer, count, [(kind, (size, held))])
    for fqn in reversed(list(ctx.captured.grads)):
        u, idx = producer(ctx.captured.grads[fqn])
        pnode = ctx.captured.params[fqn]
        src, dst = ctx.chosen(ctx.key[u]).outs[idx], ctx.chosen(ctx.key[pnode]).outs[0]
        kind, size, count = grad_reduction(ctx, src, dst, pnode)
        if kind == ALONE and in_turn(plan_steps(tuple(src), tuple(dst))):
            alone = max(alone, alone_held(ctx, size, dst, pnode) if produced else 2 * size)
        elif kind == ALONE:
            gathered += size * count
        elif kind is not None:
            layer = ctx.captured.layer_of(fqn)
            if not (layer and runs and runs[-1][0] == layer and runs[-1][1] == count):
                runs.append((layer, count, []))
            runs[-1][2].append((kind, (size, bucket_held(ctx, kind, size, dst, pnode) if produced else size)))
    for layer, count, items in runs:
        for _ in range(count if layer else 1):
            for kind, size in items:
                kinds.setdefault(kind, []).extend([size] if layer else [size] * count)
    largest = 0.0
    for kind, sizes in kinds.items():
        first = FIRST_BUCKET_BYTES if kind[0] == "all_reduce" else None
        n, total, held = 0, 0.0, 0.0
        for size, extra in sizes:
            cap = first if first is not None and n == 1 else BUCKET_BYTES
            if n == 0 or (total and total + size > cap):
                n, total, held = n + 1, 0.0, 0.0
            total += size
            held += extra
            largest = max(largest, held)
    return max(largest, alone) + gathered


def bucket_held(ctx: PassContext, kind: tuple, size: float, dst: tuple, pnode: fx.Node) -> float:
    """What one gradient of `size` produced bytes takes in its bucket beyond its reduced gradient (in its
    parameter's layout `dst`): its copy, and for a reduce-scatter its produced size beyond its shard too."""
    return 2 * size - reduced_bytes(ctx, dst, pnode) if kind[0] == "reduce_scatter" else size


def alone_held(ctx: PassContext, size: float, dst: tuple, pnode: fx.Node) -> float:
    """What a gradient of `size` produced bytes redistributed by itself takes beyond its reduced gradient (in
    its parameter's layout `dst`) while its collectives run: itself, and a buffer as large as the larger of it
    and its result (a contiguous copy for a reduce-scatter, a step's output); and, since it is waited for when
    the next such gradient exists, that one's partial sum beyond its shard, taken as large as its own (an upper
    bound where the gradients taking turns are sharded alike, as a layer's are)."""
    reduced = reduced_bytes(ctx, dst, pnode)
    return size + max(size, reduced) - reduced + max(size - reduced, 0.0)


def reduced_bytes(ctx: PassContext, dst: tuple, pnode: fx.Node) -> float:
    """Local bytes of a parameter's gradient in the parameter's layout `dst`."""
    return local_bytes(tuple(pnode.meta["val"].shape), ctx.precision.grad_dtype, dst, ctx.mesh.shape)


ALONE = "alone"  # grad_reduction's kind of a gradient reduced by itself


def grad_reduction(ctx: PassContext, src: tuple, dst: tuple, pnode: fx.Node) -> tuple:
    """How a gradient produced in layout `src` reaches its parameter's layout `dst`: (its bucket's kind (the
    collective and its axes), ALONE where it is redistributed by itself, or None where it needs no collective;
    its local bytes; how many of it (layers captured once))."""
    from autopar.codegen.grad_sync import bucketed
    from autopar.redistribute import plan_steps

    steps = plan_steps(tuple(src), tuple(dst))
    axes = bucketed(steps)
    size = local_bytes(tuple(pnode.meta["val"].shape), ctx.precision.grad_dtype, src, ctx.mesh.shape)
    scale = _scale(ctx, pnode)[1]
    if axes is not None:
        return (steps[0].kind, axes), size, max(1, round(scale))
    return (ALONE if any(st.is_comm for st in steps) else None), size, scale



def bucket_reserve(ctx: PassContext) -> float:
    """What the integer program sets aside for the gradient buckets (grad_bucket_bytes depends on the placements
    in a way its rows cannot say): one bucket, or all gradients at full size where they are less."""
    if ctx.microbatches > 1:
        return 0.0
    from autopar.codegen.grad_sync import BUCKET_BYTES

    total = sum(math.prod(ctx.captured.params[f].meta["val"].shape) * _scale(ctx, ctx.captured.params[f])[1]
                for f in ctx.captured.grads) * torch.tensor([], dtype=ctx.precision.grad_dtype).element_size()
    return float(min(BUCKET_BYTES, total))


def accumulation_bytes(ctx: PassContext) -> float:
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
