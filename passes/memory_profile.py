"""Per-rank memory over the step's schedule as a linear function of the strategy choice.

Memory at schedule point i is `static + sum_k W[i, k] * act_bytes[k][s_k]`: the persistent parameter state
(`static`, one vector over each parameter key's strategies) plus, for every key k, the weight of its
allocations live at i (how many of its instances are live, template layers kept from forward into backward
counted L/k times) times the bytes one instance's outputs take under the key's strategy s_k. All members of a
key share shapes, so a key has one bytes vector. The peak of a plan is the largest point; the integer program
constrains every candidate point, so the plan it returns fits as the step simulator measures it.

Liveness: an allocation lives from its node to its last reader (a view, or a tuple element, shares its base's
allocation, and a view of a graph input holds none), and a value saved for backward until the backward ends
(the runtime passes the saved tensors to the backward graph as inputs, held until it returns); gradients leave
at once for the persistent gradient buffers. Values computed from parameters alone (a cast or gathered weight) live during their forward uses and
again during their backward uses, since codegen recomputes them in backward rather than saving them; so do
recomputed activations (autopar/recompute.py: the plan's recomputed layers and the model's checkpointed
regions), from the point backward first needs them, and the values they are recomputed from are kept until then.
"""
from __future__ import annotations

import collections
import dataclasses
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
    keys: list[str]  # keys owning allocations, the columns of `weight`
    act_bytes: dict[str, np.ndarray]  # key -> bytes of one instance's outputs per strategy
    static: dict[str, np.ndarray]  # parameter key -> persistent bytes per strategy (all its instances)
    weight: np.ndarray  # (points, len(keys)): live instances of each key at each schedule point

    def peak(self, choice: dict[str, int]) -> tuple[float, float, int]:
        """(static bytes, peak activation bytes, schedule point of the peak) under `choice`."""
        static = sum(float(v[choice[k]]) for k, v in self.static.items())
        b = np.array([self.act_bytes[k][choice[k]] for k in self.keys])
        if not len(b):
            return static, 0.0, 0
        act = self.weight @ b
        i = int(np.argmax(act))
        return static, float(act[i]), i

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
    keys: list[str] = []
    col: dict[str, int] = {}
    act_bytes: dict[str, np.ndarray] = {}
    events: list[tuple[int, int, int, float]] = []  # (lo, hi, column, weight)
    for o in sorted(set(owner.values()) - {None}, key=pos.__getitem__):
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
    delta = np.zeros((len(nodes) + 1, len(keys)))
    for lo, hi, c, w in events:
        delta[lo, c] += w
        delta[hi + 1, c] -= w
    weight = np.cumsum(delta, axis=0)[:len(nodes)]
    static = _static(ctx)
    for k in static:  # a pipeline rank stores only its stage's parameters
        static[k] = static[k] * factor.get(k, 1.0)
    return MemoryProfile(keys, act_bytes, static, weight)


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


def _static(ctx: PassContext) -> dict[str, np.ndarray]:
    """Parameter, gradient and optimizer state (and the fp32 master copy) on each rank, per strategy of each
    parameter key, summed over the parameters (and template-scaled layers) the key stands for."""
    out: dict[str, np.ndarray] = {}
    for fqn, node in ctx.captured.params.items():
        key = ctx.key[node]
        numel = math.prod(node.meta["val"].shape)
        # A frozen parameter (no gradient) keeps no gradient or optimizer state.
        per_elem = param_state_bytes(1, ctx.precision, fqn in ctx.captured.grads)
        shard = np.array([_shard(s.outs[0], ctx.mesh.shape) for s in ctx.strategies[key]], dtype=float)
        out[key] = out.get(key, 0.0) + numel / shard * _scale(ctx, node)[1] * per_elem
    return out


def _owners(nodes: list[fx.Node]) -> dict[fx.Node, fx.Node | None]:
    """Per compute node, the node whose allocation holds its value: itself, or for a view (and a tuple getitem)
    the owner of what it views, as the saved-activation estimate counts a saved view's base once; None for a
    view of a graph input (a parameter's transpose), which holds no activation memory."""
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
