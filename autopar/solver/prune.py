"""Shrink an IlpProblem without changing its optimum: fold linear edges into per-strategy costs, merge
parallel edges, and drop strategies another strategy of the same key dominates."""
from __future__ import annotations

import collections
import dataclasses

import numpy as np

from autopar.solver.ilp import IlpEdge, IlpProblem


@dataclasses.dataclass
class Reduced:
    problem: IlpProblem
    kept: dict[str, list[int]]  # per key: original strategy index of each kept strategy

    def expand(self, choice: dict[str, int]) -> dict[str, int]:
        return {k: self.kept[k][i] for k, i in choice.items()}


def reduce_problem(p: IlpProblem) -> Reduced:
    linear = {k: np.asarray(p.compute[k], dtype=float).copy() for k in p.n_strategies}
    pair_edges: dict[tuple, list] = collections.defaultdict(list)
    for e in p.edges:
        cost = np.asarray(e.cost, dtype=float)
        if not cost.any():
            continue
        si = np.asarray(e.src_index)
        if e.dst is None:
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
    memory = {k: np.asarray(p.memory.get(k, [0.0] * n), dtype=float) for k, n in p.n_strategies.items()}
    kept = {k: _undominated(k, n, linear, memory, edges) for k, n in p.n_strategies.items()}
    new_edges = []
    for src, dst, si, di, cost in edges:
        new_edges.append(IlpEdge(src, dst, [int(si[o]) for o in kept[src]], [int(di[o]) for o in kept[dst]],
                                 cost.tolist()))
    q = IlpProblem(n_strategies={k: len(v) for k, v in kept.items()},
                   compute={k: [float(linear[k][o]) for o in kept[k]] for k in kept},
                   memory={k: [float(memory[k][o]) for o in kept[k]] for k in kept},
                   edges=new_edges, memory_limit=p.memory_limit, time_limit_s=p.time_limit_s, seed=p.seed,
                   workers=p.workers, fixed_memory=p.fixed_memory)
    return Reduced(q, kept)


def _undominated(key: str, n: int, linear, memory, edges) -> list[int]:
    """Strategy s is dropped when some t is no worse in compute, memory and every edge's cost against
    every layout of the other end (ties keep the lower index)."""
    if n < 2:
        return list(range(n))
    cols = [linear[key][:, None], memory[key][:, None]]
    for src, dst, si, di, cost in edges:
        if src == key:
            cols.append(cost[si, :])
        elif dst == key:
            cols.append(cost[:, di].T)
    f = np.concatenate(cols, axis=1)  # (n, features)
    le = (f[None, :, :] <= f[:, None, :] + 1e-15).all(axis=2)  # le[s, t]: t no worse than s everywhere
    eq = (np.abs(f[None, :, :] - f[:, None, :]) <= 1e-15).all(axis=2)
    idx = np.arange(n)
    dominated = (le & ~eq).any(axis=1) | (eq & (idx[None, :] < idx[:, None])).any(axis=1)
    return [int(i) for i in idx[~dominated]]
