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


def reduce_problem(p: IlpProblem, keep: dict[str, int] | None = None) -> Reduced:
    """`keep`: a plan (original indices) whose strategies stay, dominated or not, so that it can be started from."""
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
    features = _features(p, linear, edges, grouped, side)
    kept = {k: list(range(n)) if k in selectors else _undominated(n, features[k]) for k, n in p.n_strategies.items()}
    for k, i in (keep or {}).items():
        if k in kept and i not in kept[k]:
            kept[k] = sorted([*kept[k], i])
    new_edges = [IlpEdge(src, dst, [int(si[o]) for o in kept[src]], [int(di[o]) for o in kept[dst]], cost.tolist())
                 for src, dst, si, di, cost in edges]
    new_edges += [e.restricted(kept) for e in grouped]
    side = [e.restricted(kept) for e in side]
    q = dataclasses.replace(p, n_strategies={k: len(v) for k, v in kept.items()},
                            compute={k: [float(linear[k][o]) for o in kept[k]] for k in kept}, edges=new_edges,
                            memory=None if p.memory is None else p.memory.restricted(kept), side_edges=side,
                            links=restricted_links(p.links, kept))
    return Reduced(q, kept)


def _features(p: IlpProblem, linear, edges, grouped, side) -> dict[str, list[np.ndarray]]:
    """Per key, the columns (n_strategies x features) _undominated compares its strategies on: compute, every
    memory coefficient, and every edge's cost against every layout of the other end. A shared redistribution
    is cheaper when its consumers agree on a layout, so there a strategy is compared only with those that want
    the same layout. Each edge is read once (every key's own list is built in one pass)."""
    cols: dict[str, list[np.ndarray]] = {k: [linear[k][:, None]] for k in p.n_strategies}

    def both_ends(e: IlpEdge, m: np.ndarray) -> None:  # the matrix as features of its source's and destination's
        si = np.asarray(e.src_index)
        if e.src == e.dst:
            cols[e.src].append(m[si, np.asarray(e.dst_index)][:, None])
            return
        cols[e.src].append(m[si, :])
        if e.dst is not None:
            cols[e.dst].append(m[:, np.asarray(e.dst_index)].T)

    if p.memory is not None:
        for k, v in p.memory.static.items():
            cols[k].append(np.asarray(v, dtype=float)[:, None])
        for k, b in p.memory.terms:
            cols[k].append(np.asarray(b, dtype=float)[:, None])
        for e in [*{id(e): e for edges in p.memory.buffers for e in edges}.values(), *p.memory.pairs]:
            both_ends(e, np.asarray(e.cost, dtype=float))
    for src, dst, si, di, cost in edges:
        cols[src].append(cost[si, :])
        cols[dst].append(cost[:, di].T)
    for ln in p.links:  # t must cost no more under any selector strategy
        cols[ln.key].append(np.asarray(ln.cost, dtype=float))
    for e in side:  # waits: t must not use an axis s leaves free, nor put more of the layers' reductions there
        for m in [*(e.contends or {}).values(), *(e.axis_cost or {}).values()]:
            both_ends(e, np.asarray(m, dtype=float))
    for e in grouped:
        cost = np.asarray(e.cost, dtype=float)
        if e.group is None:
            both_ends(e, cost)
            continue
        if e.src == e.dst:  # t must use the same layout classes as s
            same = [(e.src, e.src_index), (e.src, e.dst_index)]
        else:
            cols[e.src].append(cost[np.asarray(e.src_index), :])
            same = [] if e.dst is None else [(e.dst, e.dst_index)]
        for k, classes in same:
            b = np.asarray(classes, dtype=float)[:, None]
            cols[k] += [b, -b]
    return cols


def _undominated(n: int, cols: list[np.ndarray]) -> list[int]:
    """Strategy s is dropped when some t is no worse in every feature (_features) and better in one; of equals,
    the lowest index is kept."""
    if n < 2:
        return list(range(n))
    f = np.concatenate(cols, axis=1)  # (n, features)
    le = (f[None, :, :] <= f[:, None, :] + 1e-15).all(axis=2)  # le[s, t]: t no worse than s everywhere
    eq = (np.abs(f[None, :, :] - f[:, None, :]) <= 1e-15).all(axis=2)
    idx = np.arange(n)
    dominated = (le & ~eq).any(axis=1) | (eq & (idx[None, :] < idx[:, None])).any(axis=1)
    return [int(i) for i in idx[~dominated]]


def restricted_links(links: list[IlpLink], kept: dict[str, list[int]]) -> list[IlpLink]:
    return [dataclasses.replace(ln, cost=[[ln.cost[s][r] for r in kept[ln.selector]] for s in kept[ln.key]])
            for ln in links]

