"""Package the solver's choices and the simulated step into a Plan (plain data, JSON-ready)."""
from __future__ import annotations

import hashlib

import torch.fx as fx

from autopar.passes import fp8_variants, recompute_variants
from autopar.passes.context import PassContext
from autopar.plan import NodePlan, PipelinePlan, Plan, Transition
from autopar.redistribute import describe_steps, plan_steps

N_ALTERNATIVES = 4
TIMELINE_EVENTS = 1500  # simulated events kept in the plan for its timeline plot


def build_plan_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    cap = ctx.captured
    sim = ctx.simulation
    fp8_variants.normalize_choice(ctx)
    alt = _alternatives(ctx)
    nodes = {}
    for key, strats in ctx.strategies.items():
        node = ctx.members[key][0]
        s = ctx.chosen(key)
        nodes[key] = NodePlan(op=node_op(key, node), ins=list(s.ins), outs=list(s.outs),
                              compute_s=ctx.compute_cost[key][ctx.choice[key]], count=ctx.node_count[key],
                              alternatives=alt.get(key, []), variant=s.variant,
                              variant_costs=fp8_variants.variant_costs(ctx, key, s, lambda b, k=key: _plain(ctx, k, b)))
    params = {ctx.key[node].split("/", 1)[1]: ctx.chosen(ctx.key[node]).outs[0] for node in cap.params.values()}
    inputs = [ctx.chosen(ctx.key[n]).outs[0] for n in cap.inputs]
    transitions = []
    for e, c in zip(ctx.edges, ctx.edge_cost):
        a = c.src_index[ctx.choice[e.src]]
        b = 0 if c.dst_index is None else c.dst_index[ctx.choice[e.dst]]
        src, dst = c.src_layouts[a], c.dst_layouts[b]
        if src == dst:
            continue
        steps = describe_steps(plan_steps(src, dst), ctx.mesh.axis_names)
        if c.dst_index is not None and fp8_variants.edge_class(ctx, e, ctx.chosen(e.dst)):
            steps += " in fp8"  # the weight is cast to FP8 on its shard, then gathered
        transitions.append(Transition(e.src, e.dst, e.arg, src, dst, steps, c.cost[a][b], e.count, e.kind))
    blocks = {b.prefix: b.count for b in cap.blocks}
    block_first = {b.prefix: b.first for b in cap.blocks if b.first}
    numel = {}
    for fqn, node in cap.params.items():
        n = 1
        for s in node.meta["val"].shape:
            n *= int(s)
        numel[ctx.key[node].split("/", 1)[1]] = n
    ctx.plan = Plan(
        mesh=ctx.mesh, device=ctx.hw.name, nodes=nodes, params=params, inputs=inputs, transitions=transitions,
        estimated_step_time=sim.step_time, peak_memory_per_rank=sim.peak_memory,
        cost_breakdown={"compute_s": sim.compute_time, "comm_s": sim.comm_time, "exposed_comm_s": sim.exposed_comm,
                        "optimizer_s": sim.optimizer_time, **{f"comm[{k}]_s": v for k, v in sim.comm_by_axis.items()}},
        memory_breakdown=sim.memory, fingerprint=fingerprint(ctx), blocks=blocks, block_first=block_first,
        param_numel=numel,
        memory_limit=int(ctx.memory_limit), solver_stats=dict(ctx.solver_stats), mixed_precision=ctx.precision.name,
        comm_bytes=dict(sim.comm_bytes_by_axis), timeline=[list(e) for e in sim.timeline[:TIMELINE_EVENTS]],
        batch_norms=_batch_norms(ctx), fp8=fp8_variants.summary(ctx, nodes), microbatches=ctx.microbatches,
        pipeline=PipelinePlan(**ctx.pipeline.result) if ctx.pipeline is not None and ctx.pipeline.result else None,
        recompute=recompute_variants.summary(ctx))
    return gm


def _plain(ctx: PassContext, key: str, strategy) -> float:
    """Seconds per step of a node run as captured under `strategy`'s layouts (as estimate_costs prices it)."""
    from autopar.cost import compute_time
    from autopar.passes.estimate_costs import split_of
    from autopar.rules.base import op_info

    node = ctx.members[key][0]
    return ctx.node_count[key] * compute_time(op_info(node), ctx.hw) / split_of(strategy, ctx.mesh.shape)


def _batch_norms(ctx: PassContext) -> dict[str, str]:
    """How each training batch norm gets its statistics, read from the layout of its input where the first
    statistic is taken (the fused kernel, or the first per-channel sum of the decomposed form)."""
    from torch.distributed.tensor import Shard

    cap, names = ctx.captured, ctx.mesh.axis_names
    out = {}
    for fqn in cap.batch_norms:
        key = next((k for k in (f"{fqn}/fwd/sum", f"{fqn}/fwd/_native_batch_norm_legit_functional")
                    if ctx.captured.block_relative(k) in ctx.strategies), None)
        if key is None:
            continue
        lay = ctx.chosen(cap.block_relative(key)).ins[0]
        batch = [a for a, p in zip(names, lay) if isinstance(p, Shard) and p.dim == 0]
        channels = [a for a, p in zip(names, lay) if isinstance(p, Shard) and p.dim == 1]
        out[fqn] = (f"global over {'+'.join(batch)}" if batch else
                    f"channels split over {'+'.join(channels)}" if channels else "local")
    return out


def node_op(key: str, node: fx.Node) -> str:
    """The op a plan records for a key: the ATen op, or the kind (param, input, const...) of a graph input."""
    return key.split("/", 1)[0] if node.op in ("placeholder", "get_attr") else str(node.target)


def key_count(ctx: PassContext, key: str) -> str | None:
    """How many times a key's op runs per step (a template's layers scaled to the full depth), as the
    fingerprint and plan checks compare it; None for constants, which are not scaled with their layer."""
    node = ctx.members[key][0]
    return None if node.op == "get_attr" else f"{ctx.node_count[key]:.6g}"


def fingerprint(ctx: PassContext) -> str:
    """Identity of model + inputs + mesh: the ops and shapes behind every plan key and how many times each runs
    per step (the same for a template capture and the full-depth graph when the model's layers are alike)."""
    h = hashlib.sha256()
    for key in sorted(ctx.members):
        node = ctx.members[key][0]
        v = node.meta.get("val")
        shape = tuple(v.shape) if hasattr(v, "shape") else None
        h.update(f"{key}|{node_op(key, node)}|{shape}|{key_count(ctx, key)}\n".encode())
    stacks = [(b.prefix, b.count) + ((b.first,) if b.first else ()) for b in ctx.captured.blocks]
    h.update(repr(sorted(stacks)).encode())
    h.update(repr(ctx.mesh.shape).encode())
    return h.hexdigest()[:16]


def _alternatives(ctx: PassContext) -> dict[str, list[dict]]:
    """Per key, what each other strategy would cost with every other choice held fixed."""
    incident: dict[str, list] = {}
    for e, c in zip(ctx.edges, ctx.edge_cost):
        incident.setdefault(e.src, []).append((e, c, "src"))
        if c.dst_index is not None:
            incident.setdefault(e.dst, []).append((e, c, "dst"))
    out = {}
    for key, strats in ctx.strategies.items():
        if len(strats) < 2:
            continue
        rows = []
        for i, s in enumerate(strats):
            t = ctx.compute_cost[key][i]
            for e, c, side in incident.get(key, []):
                if e.src == e.dst:
                    t += c.cost[c.src_index[i]][c.dst_index[i]]
                elif side == "src":
                    b = 0 if c.dst_index is None else c.dst_index[ctx.choice[e.dst]]
                    t += c.cost[c.src_index[i]][b]
                else:
                    t += c.cost[c.src_index[ctx.choice[e.src]]][c.dst_index[i]]
            mem = ctx.memory_cost.get(key, [0] * len(strats))[i]
            rows.append({"strategy": str(s), "time_s": float(f"{t:.6g}"), "memory_bytes": int(mem),
                         "chosen": i == ctx.choice[key]})
        rows.sort(key=lambda r: (not r["chosen"], r["time_s"], r["memory_bytes"]))
        out[key] = rows[:N_ALTERNATIVES + 1]
    return out
