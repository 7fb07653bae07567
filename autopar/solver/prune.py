"""Shrink an IlpProblem without changing its optimum: fold linear edges into per-strategy costs, merge
parallel edges, and drop strategies another strategy of the same key dominates (a selector's strategies are
all kept)."""
from __future__ import annotations

import collections
import dataclasses

import numpy as np

from autopar.solver.ilp import IlpEdge, IlpLink, IlpProblem


@dataclasses.dataclass
class Reduced:
    problem: IlpProblem
    kept: dict[str, list[int]]  # per key: original strategy index of each kept strategy

    def expand(self, choice: dict[str, int]) -> dict[str, int]:
        return {k: self.kept[k][i] for k, i in choice.items()}

    def restrict(self, choice: dict[str, int]) -> dict[str, int] | None:
        """A choice of the original problem in the reduced one's indices (None if it uses a dropped strategy)."""
        pos = {k: {o: i for i, o in enumerate(v)} for k, v in self.kept.items()}
        out = {k: pos[k].get(i) for k, i in choice.items() if k in pos}
        return None if any(v is None for v in out.values()) else out


def reduce_problem(p: IlpProblem) -> Reduced:
    linear = {k: np.asarray(p.compute[k], dtype=float).copy() for k in p.n_strategies}
    pair_edges: dict[tuple, list] = collections.defaultdict(list)
    grouped, side = [], list(p.side_edges)
    for e in p.edges:
        if e.axis_cost is not None or e.contends is not None:
            side.append(e)
            e = dataclasses.replace(e, axis_cost=None, contends=None, layered=False)
        cost = np.asarray(e.cost, dtype=float)
        if not cost.any():
            continue
        si = np.asarray(e.src_index)
        if e.group is not None:
            grouped.append(e)
        elif e.dst is None:
            linear[e.src] += cost[si, 0]
        elif e.src == e.dst:
            linear[e.src] += cost[si, np.asarray(e.dst_index)]
        elif cost.shape[0] == 1:
            linear[e.dst] += cost[0, np.asarray(e.dst_index)]
        elif cost.shape[1] == 1:
            linear[e.src] += cost[si, 0]
        else:
            # Express the edge directly over strategy pairs' layout classes; parallel edges with the same
            # classes add up.
            pair_edges[(e.src, e.dst, tuple(e.src_index), tuple(e.dst_index), cost.shape)].append(cost)
    edges = [(src, dst, np.asarray(si), np.asarray(di), sum(costs))
             for (src, dst, si, di, _), costs in pair_edges.items()]
    selectors = p.selectors()
    kept = {k: list(range(n)) if k in selectors else _undominated(k, n, linear, p, edges, grouped, side)
            for k, n in p.n_strategies.items()}
    new_edges = [IlpEdge(src, dst, [int(si[o]) for o in kept[src]], [int(di[o]) for o in kept[dst]], cost.tolist())
                 for src, dst, si, di, cost in edges]
    new_edges += [e.restricted(kept) for e in grouped]
    side = [e.restricted(kept) for e in side]
    q = dataclasses.replace(p, n_strategies={k: len(v) for k, v in kept.items()},
                            compute={k: [float(linear[k][o]) for o in kept[k]] for k in kept}, edges=new_edges,
                            memory=None if p.memory is None else p.memory.restricted(kept), side_edges=side,
                            links=restricted_links(p.links, kept))
    return Reduced(q, kept)


def _undominated(key: str, n: int, linear, p: IlpProblem, edges, grouped, side) -> list[int]:
    """Strategy s is dropped when some t is no worse in compute, in every memory coefficient and in every edge's
    cost against every layout of the other end (ties keep the lower index). A shared redistribution is cheaper
    when its consumers agree on a layout, so there t must want the same layout as s."""
    if n < 2:
        return list(range(n))
    cols = [linear[key][:, None]]
    if p.memory is not None:
        cols += [np.asarray(v, dtype=float)[:, None] for k, v in p.memory.static.items() if k == key]
        cols += [np.asarray(b, dtype=float)[:, None] for k, b in p.memory.terms if k == key]
        for e in {id(e): e for edges in p.memory.buffers for e in edges}.values():
            _edge_columns(cols, key, e, np.asarray(e.cost, dtype=float))
    for src, dst, si, di, cost in edges:
        if src == key:
            cols.append(cost[si, :])
        elif dst == key:
            cols.append(cost[:, di].T)
    for ln in p.links:  # t must cost no more under any selector strategy
        if ln.key == key:
            cols.append(np.asarray(ln.cost, dtype=float))
    for e in side:  # waits: t must not use an axis s leaves free, nor put more of the layers' reductions there
        for m in [*(e.contends or {}).values(), *(e.axis_cost or {}).values()]:
            _edge_columns(cols, key, e, np.asarray(m, dtype=float))
    for e in grouped:
        cost = np.asarray(e.cost, dtype=float)
        if e.group is None:
            _edge_columns(cols, key, e, cost)
            continue
        if e.src == key and e.dst == key:
            same = [e.src_index, e.dst_index]
        elif e.src == key:
            cols.append(cost[np.asarray(e.src_index), :])
            same = []
        else:
            same = [e.dst_index] if e.dst == key else []
        for classes in same:  # t must use the same layout class as s
            b = np.asarray(classes, dtype=float)[:, None]
            cols += [b, -b]
    f = np.concatenate(cols, axis=1)  # (n, features)
    le = (f[None, :, :] <= f[:, None, :] + 1e-15).all(axis=2)  # le[s, t]: t no worse than s everywhere
    eq = (np.abs(f[None, :, :] - f[:, None, :]) <= 1e-15).all(axis=2)
    idx = np.arange(n)
    dominated = (le & ~eq).any(axis=1) | (eq & (idx[None, :] < idx[:, None])).any(axis=1)
    return [int(i) for i in idx[~dominated]]


def restricted_links(links: list[IlpLink], kept: dict[str, list[int]]) -> list[IlpLink]:
    return [dataclasses.replace(ln, cost=[[ln.cost[s][r] for r in kept[ln.selector]] for s in kept[ln.key]])
            for ln in links]


def _edge_columns(cols: list, key: str, e: IlpEdge, m: np.ndarray) -> None:
    """The cost matrix `m` of edge e as features of `key`'s strategies (its row, its column, or its entry)."""
    si = np.asarray(e.src_index)
    if e.src == key and e.dst == key:
        cols.append(m[si, np.asarray(e.dst_index)][:, None])
    elif e.src == key:
        cols.append(m[si, :])
    elif e.dst == key:
        cols.append(m[:, np.asarray(e.dst_index)].T)
