"""Let single-input ops follow their producer: their strategy is a function of the producer's choice.

An op with one tensor input whose every possible input layout has a zero-cost strategy (views, transposes,
unary pointwise ops, clones) never needs a variable of its own: it takes the strategy that consumes its
producer's output as is. Chains resolve to one root variable, so the integer program only sees roots.
"""
from __future__ import annotations

import collections

import torch.fx as fx

from autopar.passes.context import PassContext


def merge_followers_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    incoming: dict[str, list] = collections.defaultdict(list)
    for e in ctx.edges:
        if e.kind in ("activation", "param"):
            incoming[e.dst].append(e)
    pinned = {k for k in ctx.strategies if _is_act_pinned(ctx, k)}
    leader: dict[str, tuple[str, list[int]]] = {}
    for key in _topo_keys(ctx):
        edges = incoming.get(key, [])
        if len(edges) != 1 or key in pinned or ctx.members[key][0].op != "call_function":
            continue
        e = edges[0]
        if e.src == key:
            continue
        mapping = _follow_map(ctx, e.src, e.out, key)
        if mapping is not None:
            leader[key] = (e.src, mapping)
    ctx.follow = {}
    for key in leader:
        root = key
        chain = []
        while root in leader:
            chain.append(root)
            root = leader[root][0]
        # compose: root index -> ... -> key index
        maps = [leader[k][1] for k in reversed(chain)]
        composed = list(range(len(ctx.strategies[root])))
        for m in maps:
            composed = [m[i] for i in composed]
        ctx.follow[key] = (root, composed)
    return gm


def _follow_map(ctx: PassContext, src: str, out: int, dst: str) -> list[int] | None:
    by_in: dict[tuple, int] = {}
    for j, s in enumerate(ctx.strategies[dst]):
        by_in.setdefault(s.ins[0], j)
    mapping = []
    for s in ctx.strategies[src]:
        j = by_in.get(s.outs[out])
        if j is None:
            return None
        mapping.append(j)
    return mapping


def _topo_keys(ctx: PassContext) -> list[str]:
    seen, order = set(), []
    for node in ctx.captured.gm.graph.nodes:
        k = ctx.key.get(node)
        if k is not None and k in ctx.strategies and k not in seen:
            seen.add(k)
            order.append(k)
    return order


def _is_act_pinned(ctx: PassContext, key: str) -> bool:
    import fnmatch

    return any(p.startswith("act:") and fnmatch.fnmatch(key, p[4:]) for p in (ctx.config.pins or {}))
