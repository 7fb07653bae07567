"""The placement integer program: its data, its units, and one entry point over two backends.

The math. For every key k with strategies S_k there are booleans x[k,s], sum_s x[k,s] = 1. An edge e from
key u (output layouts A_e, strategy s maps to a(s)) to key v (input layouts B_e, strategy t maps to b(t)) with
cost c_e[a,b] adds variables y[e,a,b] in [0,1] tied to x by transportation constraints

    sum_b y[e,a,b] = sum_{s: a(s)=a} x[u,s]        sum_a y[e,a,b] = sum_{t: b(t)=b} x[v,t]

so y[e,a,b] = 1 exactly when u outputs a and v wants b (integral once x is). Edges whose cost depends on one
side only, or whose two ends share a key, are linear in x and need no y. A shared redistribution (one value
consumed in one layout by several ops, redistributed once) gets z[g,a,b] >= y[e,a,b] for each of its edges e
and is priced on z. A gradient reduction's cost is the time it stays exposed after overlapping the backward
(built by passes/solve_placements.py). The objective is

    min  sum_{k,s} compute[k,s] x[k,s]  +  sum_{e,a,b} c_e[a,b] y[e,a,b]  +  sum_{g,a,b} c_g[a,b] z[g,a,b]

and memory is bounded at every candidate peak point i of the schedule (`MemoryRows`):

    sum_k static[k,s] x[k,s]  +  sum_t w[i,t] sum_s bytes_t[s] x[key(t),s]  <=  limit     for every i

(persistent parameter state plus the allocations live at i). With `objective="peak"` the program minimizes
the largest of these rows instead. On `quiet_axes`, the indicators of layout changes holding a blocking
backward collective on those axes are 0. Both backends create variables in sorted key order and run
single-threaded at a fixed seed, so the same inputs give the same plan whenever the solve ends before its
deadline.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from autopar.errors import AutoparError

# Units. HiGHS works in floating point: its objective is in milliseconds and its memory rows in MiB, so both
# stay near 1 for realistic models. CP-SAT needs integers: nanoseconds and bytes.
SECONDS_PER_HIGHS_TIME_UNIT = 1e-3
BYTES_PER_HIGHS_MEMORY_UNIT = 2**20
SECONDS_PER_CPSAT_TIME_UNIT = 1e-9
BYTES_PER_CPSAT_MEMORY_UNIT = 1

# A plan whose objective is within this fraction of the proven bound counts as optimal (HiGHS's default MIP gap).
OPTIMALITY_TOLERANCE = 1e-4

BACKENDS = ("highs", "cp-sat")

# The share of the layers' gradient reductions on an axis that blocking backward collectives there wait for.
WAIT_SHARE = 0.5


class ProgramInfeasible(AutoparError):
    """The integer program has no solution (no choice fits the memory limit)."""


@dataclasses.dataclass
class IlpEdge:
    src: str
    dst: str | None  # None: fixed destination (one layout)
    src_index: Sequence[int]
    dst_index: Sequence[int] | None
    cost: Sequence[Sequence[float]]
    group: int | None = None  # edges of one group share one redistribution per (source, destination) layout
    # A gradient reduction of the repeated layers (`layered`): its seconds on each mesh axis's links, which a
    # blocking backward collective on that axis waits behind (see IlpProblem.waits).
    axis_cost: dict[int, Sequence[Sequence[float]]] | None = None
    layered: bool = False
    # A blocking collective in the backward of repeated layers: per axis, whether (a, b) uses it. It waits
    # behind the gradient reductions queued on that axis (one communicator, one stream).
    contends: dict[int, Sequence[Sequence[bool]]] | None = None


@dataclasses.dataclass
class MemoryRows:
    """Per-rank bytes at each candidate peak point, linear in the choice: point i holds
    sum_k static[k][s_k] + sum_t weights[i][t] * terms[t][1][s_{terms[t][0]}]."""

    static: dict[str, Sequence[float]]
    terms: list[tuple[str, Sequence[float]]]
    weights: list[dict[int, float]]

    def usage(self, choice: dict[str, int]) -> float:
        """The largest row under `choice`."""
        return self.peak({k: {i: 1.0} for k, i in choice.items()})

    def peak(self, x: dict[str, dict[int, float]]) -> float:
        """The largest row at a fractional point: x[key] maps strategies to their weights."""
        base = sum(sum(w * v[i] for i, w in x[k].items()) for k, v in self.static.items())
        term = [sum(w * b[i] for i, w in x[k].items()) for k, b in self.terms]
        return base + max((sum(w * term[t] for t, w in row.items()) for row in self.weights), default=0.0)

    def key_columns(self, key: str) -> list[list[float]]:
        """Per strategy of `key`, its coefficient in each row (static first, then one per point)."""
        n = len(next(b for k, b in [*self.static.items(), *self.terms] if k == key))
        cols = [[float(self.static[key][s]) if key in self.static else 0.0 for s in range(n)]]
        for row in self.weights:
            cols.append([sum(w * self.terms[t][1][s] for t, w in row.items() if self.terms[t][0] == key)
                         for s in range(n)])
        return [list(c) for c in zip(*cols)]

    def restricted(self, kept: dict[str, list[int]]) -> "MemoryRows":
        return MemoryRows({k: [v[i] for i in kept[k]] for k, v in self.static.items()},
                          [(k, [b[i] for i in kept[k]]) for k, b in self.terms], self.weights)


@dataclasses.dataclass
class IlpProblem:
    n_strategies: dict[str, int]
    compute: dict[str, Sequence[float]]
    edges: list[IlpEdge]
    memory: MemoryRows | None = None
    memory_limit: float | None = None
    # Mesh axes on which no blocking backward collective may run (edges' `contends`): see `waits`.
    quiet_axes: frozenset[int] = frozenset()
    # Copies of the edges that carry `contends` or `axis_cost`, for `waits` and `quiet_axes` alone (pruning
    # folds the originals into per-strategy costs).
    side_edges: list[IlpEdge] = dataclasses.field(default_factory=list)
    seed: int = 0
    workers: int = 1

    def objective(self, choice: dict[str, int]) -> float:
        """Seconds the program charges for `choice` (shared redistributions once per group and layout pair)."""
        total = sum(self.compute[k][i] for k, i in choice.items())
        shared: dict[tuple, float] = {}
        for e in self.edges:
            a = e.src_index[choice[e.src]]
            b = 0 if e.dst is None else e.dst_index[choice[e.dst]]
            if e.group is None:
                total += e.cost[a][b]
            else:
                shared[(e.group, a, b)] = e.cost[a][b]
        return total + sum(shared.values())

    def waits(self, choice: dict[str, int]) -> dict[int, float]:
        """Per mesh axis where blocking backward collectives wait behind the layers' gradient reductions (one
        communicator per axis runs its collectives in order), a rough expected wait: half the layers' reduction
        time there (a collective issued at a random moment of a layer's backward finds half of that layer's
        reductions still queued). The program cannot price this (as rows it needs a big-M term whose
        relaxation is too weak to solve fast); solve_bounded uses it to decide when to offer a plan that keeps
        the axis free of such collectives (`quiet_axes`), and the step simulator chooses between them."""
        layered: dict[int, float] = {}
        busy: set[int] = set()
        for e in self.edges + self.side_edges:
            a = e.src_index[choice[e.src]]
            b = 0 if e.dst is None else e.dst_index[choice[e.dst]]
            busy |= {ax for ax, m in (e.contends or {}).items() if m[a][b]}
            if e.axis_cost is not None and e.layered:
                for ax, c in e.axis_cost.items():
                    layered[ax] = layered.get(ax, 0.0) + c[a][b]
        return {ax: WAIT_SHARE * layered[ax] for ax in sorted(busy) if layered.get(ax)}

    def fits(self, choice: dict[str, int]) -> bool:
        return self.memory is None or self.memory_limit is None or self.memory.usage(choice) <= self.memory_limit


@dataclasses.dataclass
class IlpResult:
    choice: dict[str, int]
    objective_s: float  # for objective="peak": bytes
    bound_s: float  # a proven lower bound on the optimum, same unit
    optimal: bool
    stats: dict

    @property
    def gap(self) -> float:
        """Relative distance to the proven bound."""
        if self.objective_s <= 0:
            return 0.0
        return max(0.0, (self.objective_s - self.bound_s) / self.objective_s)
