"""Per-rank memory over the step's schedule as a linear function of the strategy choice.

Memory at schedule point i is `static + sum_k W[i, k] * act_bytes[k][s_k]`: the persistent parameter state
(`static`, one vector over each parameter key's strategies) plus, for every key k, the weight of its
allocations live at i (how many of its instances are live, template layers kept from forward into backward
counted L/k times) times the bytes one instance's outputs take under the key's strategy s_k. All members of a
key share shapes, so a key has one bytes vector. The peak of a plan is the largest point; the integer program
constrains every candidate point, so the plan it returns fits as the step simulator measures it.

Liveness: an allocation lives from its node to its last reader (a view, or a tuple element, shares its base's
allocation, and a view of a graph input holds none), and a value saved for backward until the backward ends
(the runtime passes the saved tensors to the backward graph as inputs, held until it returns). The parameters'
gradient buffers (`.grad`) hold nothing during the step (`optimizer.zero_grad()` sets them to None): a
parameter's gradient counts from the op that produces it to the end of the backward, in its parameter's layout
(the reduced gradient it becomes); what it takes beyond that before it is reduced (an FSDP weight's full-size
partial sum waiting for its bucket, a bucket's copy) is the gradient collective buffers'
(simulate_step.grad_bucket_bytes). So `static` holds no gradient bytes; `term_key` names the gradient columns.
With several microbatches or under a pipeline gradients accumulate over the step instead, and `static` holds
them. Values computed from parameters alone (a cast or gathered weight) live during their forward uses and
again during their backward uses, since codegen recomputes them in backward rather than saving them; so do
recomputed activations (autopar/recompute.py: the plan's recomputed layers and the model's checkpointed
regions), from the point backward first needs them, and the values they are recomputed from are kept until then.
A value redistributed for a reader is a copy beside it (`CopyTerm`, a column per edge): its bytes depend on both
ends' layouts, so the integer program sums it over the edge's layout pairs (solver.ilp.MemoryRows.pairs).
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import math
import operator

import numpy as np
import torch
import torch.fx as fx

from autopar.cost import VIEW_OPS, param_state_bytes
from autopar.passes.annotate_shapes import _scale
from autopar.passes.context import PassContext


@dataclasses.dataclass
class MemoryProfile:
    keys: list[str]  # the columns of `weight`: keys owning allocations, then gradient terms (`term_key`)
    act_bytes: dict[str, np.ndarray]  # column -> bytes of one instance's outputs per strategy of its key
    static: dict[str, np.ndarray]  # parameter key -> persistent bytes per strategy (all its instances)
    weight: np.ndarray  # (points, len(keys)): live instances of each column at each schedule point
    # A gradient column's key (the parameter key whose gradients it counts); other columns are keys.
    term_key: dict[str, str] = dataclasses.field(default_factory=dict)
    # Parameter key -> the gradient bytes `static` holds per strategy (those without a column).
    static_grads: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    # A copy column (`COPY_TERM`): the copies redistributing one edge's value for its readers
    # (ctx.edges[edge]); their bytes depend on both ends' layouts (bytes[src_index[s], dst_index[t]]).
    copies: dict[str, "CopyTerm"] = dataclasses.field(default_factory=dict)

    def key_of(self, column: str) -> str:
        return self.term_key.get(column, column)

    def peak(self, choice: dict[str, int]) -> tuple[float, float, int]:
        """(static bytes, peak bytes of activations and produced gradients, schedule point of the peak) under
        `choice`."""
        static = sum(float(v[choice[k]]) for k, v in self.static.items())
        b = self.column_bytes(choice)
        if not len(b):
            return static, 0.0, 0
        act = self.weight @ b
        i = int(np.argmax(act))
        return static, float(act[i]), i

    def gradients_at(self, choice: dict[str, int], point: int) -> float:
        """Bytes of produced gradients live at `point` under `choice`."""
        b = self.column_bytes(choice)
        return float(sum(self.weight[point, c] * b[c] for c, k in enumerate(self.keys) if k in self.term_key))

    def copies_at(self, choice: dict[str, int], point: int) -> float:
        """Bytes of redistributed copies live at `point` under `choice`."""
        b = self.column_bytes(choice)
        return float(sum(self.weight[point, c] * b[c] for c, k in enumerate(self.keys) if k in self.copies))

    def column_bytes(self, choice: dict[str, int]) -> np.ndarray:
        """Bytes of one instance of each column under `choice`."""
        return np.array([self.copies[k].at(choice) if k in self.copies else self.act_bytes[k][choice[self.key_of(k)]]
                         for k in self.keys])


@dataclasses.dataclass
class CopyTerm:
    """The copies codegen makes of one edge's value for its readers: bytes[a][b] for the edge's source layout
    class a and destination layout class b (0 where the layouts agree)."""

    edge: int
    src: str
    dst: str
    src_index: list[int]
    dst_index: list[int]
    bytes: np.ndarray

    def at(self, choice: dict[str, int]) -> float:
        return float(self.bytes[self.src_index[choice[self.src]], self.dst_index[choice[self.dst]]])

    def candidate_points(self) -> list[int]:
        return candidate_points(self.weight)


def candidate_points(w: np.ndarray) -> list[int]:
    """Points (rows of w: live weight per allocation term) that can be the peak under some choice: a point whose
    weights are all at most another point's is never above it, whatever the choice (bytes are never
    negative)."""
    if not len(w):
        return []
    # Largest total first: a point can only be dominated by one with a larger (or equal) total.
    order = np.lexsort((np.arange(len(w)), -w.sum(axis=1)))
    kept: list[int] = []
    for i in order:
        if kept and (w[kept] >= w[i] - 1e-12).all(axis=1).any():
            continue
        kept.append(int(i))
    return sorted(kept)


def memory_profile(ctx: PassContext) -> MemoryProfile:
    """The profile of ctx's graph (built once per context)."""
    if getattr(ctx, "memory_profile", None) is None:
        ctx.memory_profile = _build(ctx)
    return ctx.memory_profile


def _build(ctx: PassContext, recomputed: set[fx.Node] | None = None) -> MemoryProfile:
    """The profile with `recomputed` (default ctx.recomputed) recomputed in backward."""
    cap = ctx.captured
    recomputed = ctx.recomputed if recomputed is None else recomputed
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
    last_bwd = max((pos[n] for n in nodes if n.op == "call_function" and cap.phase[n] == "bwd"), default=0)
    need = _recompute_points(cap, nodes, pos, recomputed)
    for n, at in need.items():
        for a in n.all_input_nodes:  # what n is recomputed from stays until then
            o = owner.get(a)
            if o is not None and o not in recomputed:
                uses[o].append(at)
    factor = ctx.pipeline.factor if ctx.pipeline is not None else {}
    grads = _gradient_outputs(ctx, owner) if produced_gradients(ctx) else {}
    keys: list[str] = []
    col: dict[str, int] = {}
    act_bytes: dict[str, np.ndarray] = {}
    events: list[tuple[int, int, int, float]] = []  # (lo, hi, column, weight)
    for o in sorted(set(owner.values()) - {None}, key=pos.__getitem__):
        if o in grads and not uses[o] and len(grads[o][1]) == len(_tensor_outputs(o)):
            continue  # gradients only: counted below, until the backward ends
        key = ctx.key[o]
        if key not in col:
            col[key] = len(keys)
            keys.append(key)
            act_bytes[key] = _key_bytes(ctx, o)
        fwd = [i for i in uses[o] if cap.phase[nodes[i]] == "fwd"]
        bwd = [i for i in uses[o] if cap.phase[nodes[i]] == "bwd"]
        w = 1.0
        if o in recomputed and cap.phase[o] == "fwd":
            again = [need[o], *bwd] if o in need else bwd
            later = [need[u] for u in o.users if u in need]
            spans = ([(pos[o], max(fwd))] if fwd else []) + ([(min(again), max(again + later))] if again else [])
        elif o in ctx.param_derived and cap.phase[o] == "fwd":
            spans = ([(pos[o], max(fwd))] if fwd else []) + ([(min(bwd), max(bwd))] if bwd else [])
        else:
            if cap.phase[o] == "fwd" and bwd:
                # Kept for the backward: one copy per layer the template stands for, and under a pipeline
                # one per microbatch a stage holds in flight (passes/split_stages.py). The runtime hands the
                # saved tensors to the backward graph as its inputs, which live until it returns.
                w = _scale(ctx, o)[1] * factor.get(key, 1.0)
                spans = [(pos[o], last_bwd)]
            else:
                spans = [(pos[o], max(uses[o], default=pos[o]))]
        events.extend((lo, hi, col[key], w) for lo, hi in spans)
    term_key: dict[str, str] = {}
    end = len(nodes) - 1
    for o in sorted(grads, key=pos.__getitem__):
        for pnode, scale in grads[o][0]:
            key = ctx.key[pnode]
            name = f"{key}{GRADIENT_TERM}"
            if name not in col:
                col[name] = len(keys)
                keys.append(name)
                term_key[name] = key
                act_bytes[name] = _gradient_bytes(ctx, pnode)
            events.append((pos[o], end, col[name], scale))
    copies: dict[str, CopyTerm] = {}
    for c, (term, spans) in enumerate(_copy_columns(ctx, nodes, pos, recomputed, need, last_bwd)):
        name = f"{term.edge}{COPY_TERM}"
        col[name] = len(keys)
        keys.append(name)
        copies[name] = term
        events.extend((lo, hi, col[name], w) for lo, hi, w in spans)
    delta = np.zeros((len(nodes) + 1, len(keys)))
    for lo, hi, c, w in events:
        delta[lo, c] += w
        delta[hi + 1, c] -= w
    weight = np.cumsum(delta, axis=0)[:len(nodes)]
    # A gradient the profile found no allocation for (a view of a graph input) stays in the static state.
    counted = {pnode for o in grads for pnode, _ in grads[o][0]}
    static, kept = _static(ctx, produced=counted), _static(ctx, produced=counted, grads_only=True)
    for k in static:  # a pipeline rank stores only its stage's parameters and buffers
        static[k] = static[k] * factor.get(k, 1.0)
    for k in kept:
        kept[k] = kept[k] * factor.get(k, 1.0)
    return MemoryProfile(keys, act_bytes, static, weight, term_key, kept, copies)


GRADIENT_TERM = "#grad"  # a gradient column's name: its parameter key and this
COPY_TERM = "#copy"  # a copy column's name: its edge's index in ctx.edges and this


def copies_counted(ctx: PassContext) -> bool:
    """Whether the profile counts redistributed copies: not under a pipeline (whose stage memory is its own,
    passes/split_stages.py)."""
    return ctx.pipeline is None and bool(ctx.edge_cost)


def grads_in_one_bucket(ctx: PassContext) -> bool:
    """Whether every kind of gradient reduction fills a single bucket whatever the placements (all gradients
    at full size fit the first one): then grad_bucket_bytes is linear in the (producer, parameter) layout
    pairs but for a largest-of over kinds, and the integer program counts it exactly."""
    from autopar.codegen.grad_sync import FIRST_BUCKET_BYTES

    if ctx.microbatches > 1 or ctx.pipeline is not None:
        return False
    size = torch.tensor([], dtype=ctx.precision.grad_dtype).element_size()
    total = sum(math.prod(p.meta["val"].shape) * size * max(1, round(_scale(ctx, p)[1]), _scale(ctx, p)[1])
                for p in (ctx.captured.params[f] for f in ctx.captured.grads))
    return total <= FIRST_BUCKET_BYTES


def _copy_columns(ctx: PassContext, nodes: list[fx.Node], pos: dict, recomputed: set[fx.Node],
                  need: dict[fx.Node, int], last_bwd: int) -> list[tuple[CopyTerm, list[tuple[int, int, float]]]]:
    """Per edge whose value a reader may read in another layout, its copies' term and their live spans (lo, hi,
    instances). Codegen redistributes a value once per (layout, phase) for the reads that want it there
    (codegen/lower.py), right before the first: a read's copy lives while its reader runs, and where the reader
    is a view of it (a reshape of the gathered value) as long as that view, until the backward ends when the
    view is saved for it. A recomputed reader reads its copy again where the backward recomputes it. A gathered
    parameter (FSDP) lives with its layer's bucket: from the layer's first parameter read to its last, in each
    phase (the backward gathers again rather than keeping it); a parameter outside the layers from its first
    read in a phase to its last there. Every column exists whatever the variants recomputed, in edge order, so
    profiles of several variants share their columns."""
    from autopar.passes.annotate_shapes import tensor_reads

    if not copies_counted(ctx):
        return []
    cap = ctx.captured
    index = {(e.src, e.out, e.dst, e.arg, e.kind): i for i, e in enumerate(ctx.edges)}
    reads: dict[int, list[tuple[fx.Node, fx.Node]]] = collections.defaultdict(list)  # edge -> (value, reader)
    for v in nodes:
        if v.op != "call_function" or v.target is operator.getitem:
            continue
        for i, a, u, out, kind in tensor_reads(ctx, v):
            e = index.get((ctx.key.get(u), out, ctx.key.get(v), i, kind))
            if e is not None:
                reads[e].append((a, v))
    # Parameter reads per (layer, phase) and per (value, phase): the spans their gathered copies live. A read
    # the backward recomputes belongs to the backward's, at its recompute point.
    def param_reads(a: fx.Node, v: fx.Node) -> list[tuple[tuple, int]]:
        layer = cap.block_of.get(v)
        out = []
        for phase, at in [(cap.phase[v], pos[v])] + ([("bwd", need[v])] if v in recomputed and v in need else []):
            out.append((("layer", layer, phase) if layer is not None else ("value", a, phase), at))
        return out

    span: dict[tuple, list[int]] = {}
    for e, rs in reads.items():
        if ctx.edges[e].kind != "param":
            continue
        for a, v in rs:
            for group, at in param_reads(a, v):
                lo, hi = span.setdefault(group, [at, at])
                span[group] = [min(lo, at), max(hi, at)]
    # Codegen issues the next bucket of a phase when it waits for one (a prefetch): it lives from there.
    for phase in ("fwd", "bwd"):
        order = sorted((g for g in span if g[2] == phase), key=lambda g: span[g][0])
        for g, h in reversed(list(zip(order, order[1:]))):
            span[h][0] = min(span[h][0], span[g][0])
    seen: set[tuple] = set()  # (value, group): one gathered copy serves every read of it there
    out = []
    if getattr(ctx, "copy_bytes", None) is None:  # per edge, built once per context
        ctx.copy_bytes = {}
    for e in sorted(reads):
        edge, c = ctx.edges[e], ctx.edge_cost[e]
        if e not in ctx.copy_bytes:
            ctx.copy_bytes[e] = _copy_bytes(ctx, edge, c)
        matrix = ctx.copy_bytes[e]
        if not matrix.any():
            continue
        spans = []
        for a, v in reads[e]:
            if edge.kind == "param":
                for group, at in param_reads(a, v):
                    lo, hi = span[group] if (a, group) not in seen else (at, at)
                    seen.add((a, group))
                    spans.append((lo, hi, 1.0))
                continue
            fwd_uses, bwd_uses = _alias_uses(v, pos, cap)
            fwd = cap.phase[v] == "fwd"
            if v in recomputed and fwd:
                spans.append((pos[v], max([pos[v], *fwd_uses]), 1.0))
                if v in need:
                    spans.append((need[v], max([need[v], *bwd_uses]), 1.0))
            elif fwd and bwd_uses:  # a view of the copy kept for the backward
                spans.append((pos[v], last_bwd, _scale(ctx, v)[1]))
            else:
                spans.append((pos[v], max([pos[v], *fwd_uses, *bwd_uses]), 1.0))
        out.append((CopyTerm(e, edge.src, edge.dst, list(c.src_index), list(c.dst_index), matrix), spans))
    return out


def _alias_uses(v: fx.Node, pos: dict, cap) -> tuple[list[int], list[int]]:
    """Where a reader that is a view of its input (or of a tuple element) is read, through views of it, per
    phase; none for a reader that allocates its own output."""
    fwd: list[int] = []
    bwd: list[int] = []
    if not _is_view(v):
        return fwd, bwd
    stack, seen = [v], {v}
    while stack:
        n = stack.pop()
        for u in n.users:
            if u.op != "call_function" or u in seen:
                continue
            seen.add(u)
            (fwd if cap.phase[u] == "fwd" else bwd).append(pos[u])
            if _is_view(u):
                stack.append(u)
    return fwd, bwd


def _is_view(n: fx.Node) -> bool:
    return n.op == "call_function" and (n.target is operator.getitem or (
        getattr(n.target, "overloadpacket", None) in VIEW_OPS and bool(n.all_input_nodes)))


def _copy_bytes(ctx: PassContext, edge, c) -> np.ndarray:
    """Bytes a rank holds for one copy of an edge's value per (source, destination) layout class: every step of
    a redistribution makes a new tensor (codegen/collectives.py), the largest of them counted."""
    from autopar.passes.estimate_costs import compute_dtype

    shape, dtype, sizes = tuple(edge.meta.shape), compute_dtype(edge.meta.dtype, ctx), ctx.mesh.shape
    out = np.zeros((len(c.src_layouts), len(c.dst_layouts)))
    for i, a in enumerate(c.src_layouts):
        for j, b in enumerate(c.dst_layouts):
            if tuple(a) != tuple(b):
                out[i, j] = _largest_step(shape, dtype, tuple(a), tuple(b), sizes, edge.kind == "param")
    return out


@functools.lru_cache(maxsize=65536)
def _largest_step(shape, dtype, src, dst, sizes, bucketed: bool = False) -> float:
    """The largest tensor the steps from `src` to `dst` make; with `bucketed`, a parameter gathered in one
    all_gather holds its shard's copy in the bucket's input (codegen/collectives.py) too."""
    from autopar.passes.estimate_costs import local_bytes
    from autopar.redistribute import after_step, plan_steps

    cur, most = src, 0
    steps = plan_steps(src, dst)
    for st in steps:
        cur = after_step(cur, st)
        most = max(most, local_bytes(shape, dtype, cur, sizes))
    if bucketed and len(steps) == 1 and steps[0].kind == "all_gather":
        most += local_bytes(shape, dtype, src, sizes)
    return float(most or local_bytes(shape, dtype, dst, sizes))


def produced_gradients(ctx: PassContext) -> bool:
    """Whether the profile counts gradients where the backward produces them (one microbatch, no pipeline);
    else they are persistent state from the start of the step."""
    return ctx.microbatches == 1 and ctx.pipeline is None


def _gradient_outputs(ctx: PassContext, owner: dict) -> dict[fx.Node, tuple[list[tuple[fx.Node, float]], set[int]]]:
    """Per allocation holding parameter gradients: its (parameter, instances (template-scaled layers)) and the
    indices of the outputs holding them."""
    from autopar.passes.annotate_shapes import producer

    out: dict[fx.Node, tuple[list[tuple[fx.Node, float]], set[int]]] = {}
    for fqn, g in ctx.captured.grads.items():
        n = g
        while n.op == "call_function" and n.target is not operator.getitem and owner.get(n) is not n:
            if owner.get(n) is None or not n.all_input_nodes:
                n = None
                break
            n = n.all_input_nodes[0]  # a view of the allocation
        if n is None or n.op != "call_function":
            continue
        u, idx = producer(n)
        if owner.get(u) is not u:
            continue
        pnode = ctx.captured.params[fqn]
        params, outputs = out.setdefault(u, ([], set()))
        params.append((pnode, _scale(ctx, pnode)[1]))
        outputs.add(idx)
    return out


def _gradient_bytes(ctx: PassContext, pnode: fx.Node) -> np.ndarray:
    """Bytes of one instance of a parameter's gradient in the parameter's layout, per strategy of its key."""
    from autopar.passes.estimate_costs import local_bytes

    shape = tuple(pnode.meta["val"].shape)
    return np.array([local_bytes(shape, ctx.precision.grad_dtype, s.outs[0], ctx.mesh.shape)
                     for s in ctx.strategies[ctx.key[pnode]]])


def _tensor_outputs(n: fx.Node) -> list[int]:
    val = n.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else [val]
    return [i for i, v in enumerate(vals) if isinstance(v, torch.Tensor)]


def _recompute_points(cap, nodes: list[fx.Node], pos: dict, recomputed: set[fx.Node]) -> dict[fx.Node, int]:
    """Per recomputed node, the schedule point where backward recomputes it: its first backward use, or the
    recomputation of a recomputed node that reads it, whichever comes first."""
    need: dict[fx.Node, int] = {}
    for n in reversed(nodes):
        if n not in recomputed:
            continue
        at = [pos[u] for u in n.users if u.op == "call_function" and cap.phase[u] == "bwd"]
        at += [need[u] for u in n.users if u in need]
        if at:
            need[n] = min(at)
    return need


def _static(ctx: PassContext, produced: set[fx.Node] = frozenset(), grads_only: bool = False
            ) -> dict[str, np.ndarray]:
    """Parameter, optimizer state (and the fp32 master copy) and gradient buffers on each rank, but the gradients
    of the parameters in `produced` (counted where the backward produces them), per strategy of each parameter
    key, summed over the parameters (and template-scaled layers) the key stands for, and the module buffers the
    step reads per strategy of theirs; `grads_only`: the gradient buffers alone."""
    out: dict[str, np.ndarray] = {}
    for fqn, node in ctx.captured.params.items():
        key = ctx.key[node]
        numel = math.prod(node.meta["val"].shape)
        # A frozen parameter (no gradient) keeps no gradient or optimizer state.
        trained = fqn in ctx.captured.grads
        grad = ctx.precision.grad_dtype.itemsize if trained and node not in produced else 0
        per_elem = grad if grads_only else param_state_bytes(1, ctx.precision, trained) - (
            ctx.precision.grad_dtype.itemsize if trained and node in produced else 0)
        shard = np.array([_shard(s.outs[0], ctx.mesh.shape) for s in ctx.strategies[key]], dtype=float)
        out[key] = out.get(key, 0.0) + numel / shard * _scale(ctx, node)[1] * per_elem
    if not grads_only:
        for key, b in [*buffer_bytes(ctx).items(), *input_bytes(ctx).items()]:
            out[key] = out.get(key, 0.0) + b
    return out


def input_bytes(ctx: PassContext) -> dict[str, np.ndarray]:
    """Per key of a user input (the batch), the bytes one rank holds through the step under each of the key's
    strategies. The runtime takes the rank's shard of the global batch and moves it to the device
    (runtime.module._local_inputs): on a GPU mesh that is the shard's copy; on a CPU mesh the caller's global
    batch is already on the device and a shard along dim 0 is a view of it, so the global batch counts, and a
    shard along another dim is copied beside it."""
    from torch.distributed.tensor import Shard

    from autopar.passes.estimate_costs import local_bytes

    out: dict[str, np.ndarray] = {}
    for node in ctx.captured.inputs:
        key, val = ctx.key.get(node), node.meta.get("val")
        if key not in ctx.strategies or not isinstance(val, torch.Tensor):
            continue
        shape, sizes = tuple(val.shape), ctx.mesh.shape
        per = []
        for s in ctx.strategies[key]:
            shard = local_bytes(shape, val.dtype, s.outs[0], sizes)
            if ctx.mesh.device_type == "cpu":
                copied = any(isinstance(p, Shard) and p.dim != 0 for p in s.outs[0])
                shard = local_bytes(shape, val.dtype, (), sizes) + (shard if copied else 0)
            per.append(shard)
        out[key] = out.get(key, 0.0) + np.array(per, dtype=float)
    return out


def buffer_bytes(ctx: PassContext) -> dict[str, np.ndarray]:
    """Per key of a module buffer the step reads (rotary tables, batch norm statistics), its bytes on one rank
    under each of the key's strategies."""
    out: dict[str, np.ndarray] = {}
    for node in ctx.captured.buffers.values():
        key = ctx.key.get(node)
        if key is None or key not in ctx.strategies:
            continue
        size = math.prod(node.meta["val"].shape) * node.meta["val"].dtype.itemsize * _scale(ctx, node)[1]
        shard = np.array([_shard(s.outs[0], ctx.mesh.shape) for s in ctx.strategies[key]], dtype=float)
        out[key] = out.get(key, 0.0) + size / shard
    return out


def _owners(nodes: list[fx.Node]) -> dict[fx.Node, fx.Node | None]:
    """Per compute node, the node whose allocation holds its value: itself, or for a view (and a tuple getitem)
    the owner of what it views, as the saved-activation estimate counts a saved view's base once; None for a
    view of a graph input (a parameter's transpose), which holds no activation memory."""
    owner: dict[fx.Node, fx.Node | None] = {}
    for n in nodes:
        if n.op != "call_function":
            continue
        if _is_view(n):
            a = n.args[0] if n.target is operator.getitem else n.all_input_nodes[0]
            owner[n] = owner.get(a) if a.op == "call_function" else None
        else:
            owner[n] = n
    return owner


def _key_bytes(ctx: PassContext, n: fx.Node) -> np.ndarray:
    """Bytes of a node's tensor outputs on one rank under each strategy of its key."""
    from autopar.passes.estimate_costs import compute_dtype, local_bytes

    val = n.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else [val]
    out = []
    for strat in ctx.strategies[ctx.key[n]]:
        total = 0.0
        for i, v in enumerate(vals):
            if isinstance(v, torch.Tensor) and i < len(strat.outs):
                total += local_bytes(tuple(v.shape), compute_dtype(v.dtype, ctx), strat.outs[i], ctx.mesh.shape)
        out.append(total)
    return np.array(out)


def _shard(layout, sizes) -> int:
    from torch.distributed.tensor import Shard

    return math.prod(n for p, n in zip(layout, sizes) if isinstance(p, Shard))
