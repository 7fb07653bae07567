"""Pipeline stages over a mesh axis named pp (pipe, pipeline): which layers each stage runs, which
torch.distributed.pipelining schedule runs them, and what each pipeline rank holds.

Two passes around the solve. `stage_memory_pass` gives every plan key a side (before the repeated layers:
the embedding, on the first stage; a layer; after them: head and loss, on the last stage) and scales the ILP's
memory to one pipeline rank's share: parameter state of ceil(L / pp) layers plus the first and last stages'
extras, activations of those layers times pp microbatches in flight (what 1F1B holds on the first stage). So the
placements inside a stage are solved for the memory a stage has. `split_stages_pass` then prices one layer and
the extras under the chosen placements (forward, backward split into its input-gradient and weight-gradient
parts, transfers, gradient reductions, optimizer, saved bytes), and for every schedule cuts the layers into
balanced stages, simulates the step (autopar.cost.pipeline) and checks each rank's memory in that schedule's
order; the fastest schedule that fits is the plan's.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import operator

import torch.fx as fx

from autopar.cost import link_spec
from autopar.cost.pipeline import ScheduleError
from autopar.cost.stages import Model, Part, price
from autopar.errors import InfeasibleMemoryError
from autopar.passes import recompute_variants
from autopar.passes.context import PassContext
from autopar.passes.estimate_costs import local_bytes
from autopar.passes.memory_profile import memory_profile
from autopar.sides import node_sides

# Schedules the planner weighs, with their virtual stages per rank.
CANDIDATES = (("ScheduleGPipe", 1), ("Schedule1F1B", 1), ("ScheduleInterleaved1F1B", 2),
              ("ScheduleInterleavedZeroBubble", 2), ("ScheduleZBVZeroBubble", 2))


@dataclasses.dataclass
class Setup:
    axis: int
    size: int
    prefix: str
    layers: int
    side: dict[str, str]  # plan key -> "first" | "block" | "last"
    memory: dict[str, list[float]]  # the ILP's memory per strategy before scaling (one whole model)
    factor: dict[str, float] = dataclasses.field(default_factory=dict)  # key -> its share on one pipeline rank
    transient: float = 0.0
    result: dict | None = None  # the pipeline plan (autopar.plan.PipelinePlan fields)


def pipelined(ctx: PassContext) -> bool:
    return ctx.pipeline_axis is not None and ctx.mesh.shape[ctx.pipeline_axis] > 1


def stage_memory_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    if not pipelined(ctx):
        return gm
    setup = ctx.pipeline = _setup(ctx)
    setup.factor = {key: _memory_factor(ctx, setup, key) for key in ctx.strategies}
    for key, costs in ctx.memory_cost.items():
        ctx.memory_cost[key] = [c * setup.factor[key] for c in costs]
    ctx.memory_profile = None  # rebuilt with the factors (passes/memory_profile.py)
    return gm


def _setup(ctx: PassContext) -> Setup:
    cap = ctx.captured
    axis = ctx.pipeline_axis
    name = ctx.mesh.axis_names[axis]
    if len(cap.blocks) != 1:
        what = "no repeated layers (an nn.ModuleList of identical blocks)" if not cap.blocks else \
            f"{len(cap.blocks)} repeated layer stacks ({', '.join(b.prefix for b in cap.blocks)})"
        raise ValueError(f"pipeline stages cut a model between the layers of one repeated stack; this model has "
                         f"{what}. Use a mesh without the {name!r} axis (or rename it)")
    block = cap.blocks[0]
    p = ctx.mesh.shape[axis]
    if block.count < p:
        raise ValueError(f"the {name!r} axis has {p} stages but the model has {block.count} layers in "
                         f"{block.prefix}: use a pipeline axis of at most {block.count}")
    return Setup(axis, p, block.prefix, block.count, _sides(ctx), {k: list(v) for k, v in ctx.memory_cost.items()})


def _memory_factor(ctx: PassContext, setup: Setup, key: str) -> float:
    per_rank = math.ceil(setup.layers / setup.size) / setup.layers
    param = key.startswith("param/")
    side = setup.side.get(key, "first")
    if side == "block":
        return per_rank if param else per_rank * setup.size
    return 1.0 if param or side == "last" else float(setup.size)


# The kinds of persistent state a rank holds (the step simulator's memory breakdown), split across stages.
PERSISTENT = ("params", "buffers", "grads", "optimizer", "master_weights")


def stage_memory(ctx: PassContext, memory: dict[str, int], activation_peak: float) -> tuple[dict[str, int], int]:
    """One pipeline rank's memory as the ILP bounds it (see stage_memory_pass): its stage's persistent state
    and `activation_peak`, the peak of the memory profile with a stage's saved activations counted once per
    microbatch in flight. What that peak holds beyond the saved activations is the working memory of one
    microbatch (Setup.transient), which the schedules' memory check adds to their in-flight activations."""
    setup: Setup = ctx.pipeline
    static = memory_profile(ctx).peak(ctx.choice)[0]
    saved = sum(c[ctx.choice[k]] for k, c in ctx.memory_cost.items() if not k.startswith("param/"))
    setup.transient = max(0.0, activation_peak - saved)
    whole = sum(memory.get(k, 0) for k in PERSISTENT) or 1
    out = {k: int(memory[k] * static / whole) for k in PERSISTENT
           if k in memory}
    out["activations"] = int(activation_peak)
    return out, int(static + activation_peak)


# --- sides, and what one layer costs -----------------------------------------------------------------------
def _sides(ctx: PassContext) -> dict[str, str]:
    """Plan key -> side (autopar.sides.node_sides; a key of a layer's nodes is "block")."""
    out: dict[str, str] = {}
    for n, s in node_sides(ctx.captured).items():
        key = ctx.key.get(n)
        if key is not None:
            out[key] = "block" if out.get(key) == "block" else s
    return out


def _input_gradient_keys(ctx: PassContext, setup: Setup) -> set[str]:
    """Backward keys on the input-gradient chain: nodes from which some path reaches the backward of an earlier
    part of the model (a lower layer, or the embedding). The other backward nodes only compute weight
    gradients, which zero-bubble schedules run later."""
    cap = ctx.captured
    nodes = list(cap.gm.graph.nodes)

    def pos(n: fx.Node) -> int:
        if n in cap.block_of:
            return cap.block_of[n][1]
        return -1 if setup.side.get(ctx.key.get(n)) == "first" else 1 << 30

    reach: dict[fx.Node, int] = {}
    out = set()
    for n in reversed(nodes):
        if n.op != "call_function" or cap.phase[n] != "bwd":
            continue
        r = min((min(pos(u), reach.get(u, 1 << 30)) for u in n.users
                 if u.op == "call_function" and cap.phase[u] == "bwd"), default=1 << 30)
        reach[n] = r
        if r < pos(n):
            out.add(ctx.key[n])
    return out


def _chosen_edge_cost(ctx: PassContext, e, c) -> float:
    a = c.src_index[ctx.choice[e.src]]
    b = 0 if c.dst_index is None else c.dst_index[ctx.choice[e.dst]]
    return c.cost[a][b]


def stage_model(ctx: PassContext) -> Model:
    """One layer and the extras before and after the layers, priced under the chosen placements."""
    setup: Setup = ctx.pipeline
    L = setup.layers
    acc = {s: collections.defaultdict(float) for s in ("first", "block", "last")}
    iw = _input_gradient_keys(ctx, setup)
    cap = ctx.captured

    def field(key: str) -> str:
        node = ctx.members[key][0]
        if node.op != "call_function" or cap.phase[node] == "fwd":
            return "forward"
        return "backward_input" if key in iw else "backward_weight"

    share = recompute_variants.fractions(ctx, ctx.recomputed)
    for key in ctx.strategies:
        side, c = setup.side.get(key, "first"), ctx.compute_cost[key][ctx.choice[key]]
        # Recomputed forward ops run again before the backward that reads them (on the input-gradient path).
        acc[side]["backward_input"] += share.get(key, 0.0) * c
        if key.startswith("param/"):
            acc[side]["optimizer"] += c
        else:
            acc[side][field(key)] += c
        mem = setup.memory.get(key)
        if mem is not None:
            acc[side]["static" if key.startswith("param/") else "saved"] += mem[ctx.choice[key]]
    for e, c in zip(ctx.edges, ctx.edge_cost):
        t = _chosen_edge_cost(ctx, e, c)
        if e.kind == "grad":
            acc[setup.side.get(e.dst, "first")]["grad_sync"] += t
        elif e.kind in ("loss", "buffer"):
            acc["last" if e.kind == "loss" else setup.side.get(e.src, "first")]["forward"] += t
        else:
            acc[setup.side.get(e.dst, "first")][field(e.dst)] += t
    layer = Part(**{k: v / L for k, v in acc["block"].items()})
    link = link_spec(ctx.hw, ctx.mesh.links[setup.axis])
    send = link.latency + _boundary_bytes(ctx) / link.bandwidth
    return Model(L, layer, Part(**acc["first"]), Part(**acc["last"]), send, setup.transient)


def _boundary_bytes(ctx: PassContext) -> float:
    """Bytes one rank sends from a stage to the next per microbatch: the forward values a layer reads from the
    layers (or the embedding) before it, in their planned layouts."""
    cap = ctx.captured
    target = 1 if cap.blocks[0].captured > 1 else 0
    crossing = set()
    for n in cap.gm.graph.nodes:
        if cap.block_of.get(n, (None, -1))[1] != target or cap.phase.get(n) != "fwd":
            continue
        for a in n.all_input_nodes:
            u = a.args[0] if a.op == "call_function" and a.target is operator.getitem else a
            if u.op == "call_function" and cap.phase[u] == "fwd" and cap.block_of.get(u, (None, -1))[1] < target \
                    and u not in ctx.param_derived and ctx.pipeline.side.get(ctx.key[u]) != "last":
                crossing.add(a)
    total = 0.0
    for a in crossing:
        u, idx = (a.args[0], int(a.args[1])) if a.target is operator.getitem else (a, 0)
        val = a.meta["val"]
        if ctx.key[u] in ctx.strategies:
            lay = ctx.chosen(ctx.key[u]).outs[idx]
            total += local_bytes(tuple(val.shape), val.dtype, lay, ctx.mesh.shape)
    return total


# --- the pass after the solve --------------------------------------------------------------------------------
def split_stages_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    if not pipelined(ctx):
        return gm
    setup: Setup = ctx.pipeline
    model = stage_model(ctx)
    p, m = setup.size, ctx.microbatches
    priced, refused = [], []
    pinned = ctx.config.pipeline_schedule
    for schedule, v in CANDIDATES:
        if pinned is not None and schedule != pinned:
            continue
        try:
            priced.append(price(model, schedule, p, m, v))
        except ScheduleError as e:
            refused.append(f"{schedule}: {e}")
    if not priced:
        raise ValueError(f"no pipeline schedule runs {m} microbatches on {p} stages ({'; '.join(refused)}); "
                         f"set Config(microbatches=...) to a multiple of {p} that divides the batch")
    fits = [c for c in priced if c.peak_memory <= ctx.memory_limit]
    if not fits:
        low = min(priced, key=lambda c: c.peak_memory)
        raise InfeasibleMemoryError(
            f"no pipeline schedule fits {ctx.memory_limit / 2**30:.2f} GiB per rank with {m} microbatches on {p} "
            f"stages: the smallest, {low.schedule}, needs {low.peak_memory / 2**30:.2f} GiB; use more microbatches, "
            "more ranks on the other axes, or raise memory_limit_gb")
    best = min(fits, key=lambda c: c.step_time)
    setup.result = _result(ctx, setup, best, priced, model.send)
    sim = ctx.simulation
    worst = max(range(len(best.memory)), key=best.memory.__getitem__)
    static = best.memory_parts[worst]["static"]
    whole = sum(sim.memory.get(k, 0) for k in PERSISTENT) or 1
    sim.memory = {k: int(sim.memory[k] * static / whole) for k in PERSISTENT
                  if k in sim.memory}
    sim.memory["activations"] = int(best.memory_parts[worst]["activations"])
    sim.peak_memory = int(best.peak_memory)
    sim.compute_time = max(best.timeline.busy)
    sim.exposed_comm = max(0.0, best.step_time - sim.compute_time - sim.optimizer_time)
    sim.step_time = best.step_time
    return gm


def _result(ctx: PassContext, setup: Setup, best, priced, send: float) -> dict:
    ranks = {s: r for s, r in best.timeline.stage_rank.items()}
    layers, start = [], 0
    for c in best.counts:
        layers.append([start, start + c])
        start += c
    # Modules in the order the model declares their parameters.
    order: dict[str, int] = {}
    for node in ctx.captured.params.values():
        order.setdefault(ctx.key[node], len(order))
    keys = sorted((k for k in setup.side if k in order), key=order.__getitem__)
    first = list(dict.fromkeys(_module(k) for k in keys if setup.side[k] == "first"))
    last = list(dict.fromkeys(_module(k) for k in keys if setup.side[k] == "last"))
    modules = []
    offset = ctx.captured.blocks[0].first  # the stack's layers are prefix.offset onwards
    for s, (a, b) in enumerate(layers):
        mods = (first if s == 0 else []) + [f"{setup.prefix}.{offset + i}" for i in range(a, b)]
        modules.append(mods + (last if s == len(layers) - 1 else []))
    return dict(
        axis=ctx.mesh.axis_names[setup.axis], ranks=setup.size, stages=len(best.counts), virtual_stages=best.virtual,
        schedule=best.schedule, microbatches=ctx.microbatches, stage_ranks=[ranks[s] for s in range(len(layers))],
        stage_layers=layers, stage_modules=modules, bubble_fraction=best.timeline.bubble_fraction,
        step_time_s=best.step_time, stage_time_s=[p.time for p in best.parts], send_s=send,
        memory_per_rank=[int(x) for x in best.memory],
        schedules=[{"schedule": c.schedule, "virtual_stages": c.virtual, "step_time_s": c.step_time,
                    "bubble_fraction": c.timeline.bubble_fraction, "peak_memory": int(c.peak_memory),
                    "fits": c.peak_memory <= ctx.memory_limit}
                   for c in sorted(priced, key=lambda c: c.step_time)],
        timeline=best.timeline.gantt()[:TIMELINE_EVENTS])


TIMELINE_EVENTS = 1500


def _module(param_key: str) -> str:
    return param_key.split("/", 1)[1].rpartition(".")[0]
