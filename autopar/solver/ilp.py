"""The placement integer program: its data, its units, and one entry point over two backends.

The math. For every key k with strategies S_k there are booleans x[k,s], sum_s x[k,s] = 1. An edge e from
key u (output layouts A_e, strategy s maps to a(s)) to key v (input layouts B_e, strategy t maps to b(t)) with
cost c_e[a,b] adds variables y[e,a,b] in [0,1] tied to x by transportation constraints

    sum_b y[e,a,b] = sum_{s: a(s)=a} x[u,s]        sum_a y[e,a,b] = sum_{t: b(t)=b} x[v,t]

so y[e,a,b] = 1 exactly when u outputs a and v wants b (integral once x is). Edges whose cost depends on one
side only, or whose two ends share a key, are linear in x and need no y. A shared redistribution (one value
consumed in one layout by several ops, redistributed once) gets a column w[g,b] of seconds per destination
layout b, w[g,b] >= sum_a c_g[a,b] y[e,a,b] for each of its edges e, and is priced on w. A gradient
reduction's cost is the time it stays exposed after overlapping the backward (built by
passes/solve_placements.py). The objective is

    min  sum_{k,s} compute[k,s] x[k,s]  +  sum_{e,a,b} c_e[a,b] y[e,a,b]  +  sum_{g,b} w[g,b]

and memory is bounded at every candidate peak point i of the schedule (`MemoryRows`):

    sum_k static[k,s] x[k,s]  +  sum_t w[i,t] sum_s bytes_t[s] x[key(t),s]  <=  limit     for every i

(persistent parameter state plus the allocations live at i). A link ties a key u to a selector key v (a
choice made for many keys at once, such as a layer stack's recompute variant) by transportation variables
y[l,s,r] as above, one per (strategy of u, strategy of v), priced per pair; a memory term may be conditional
on the selector (its allocation lives as the point weights say only under selector strategy r), and is then
summed over y[l,s,r] instead of x[u,s]. A term may also be an edge's: bytes per (source layout, destination
layout) pair, summed over the edge's transportation variables y[e,a,b] (a value's copy in its reader's layout).
With `objective="peak"` the program minimizes
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

    def restricted(self, kept: dict[str, list[int]]) -> "IlpEdge":
        """The edge over the strategies `kept` lists per key."""
        return dataclasses.replace(self, src_index=[self.src_index[i] for i in kept[self.src]],
                                   dst_index=None if self.dst is None else [self.dst_index[i] for i in kept[self.dst]])


@dataclasses.dataclass
class IlpLink:
    """A key tied to a selector key: `cost[s][r]` seconds when the key takes strategy s and the selector r (a
    layer's recompute time under each variant), and the pairs conditional memory terms sum over."""

    key: str
    selector: str
    cost: Sequence[Sequence[float]]


@dataclasses.dataclass
class MemoryRows:
    """Per-rank bytes at each candidate peak point, linear in the choice: point i holds
    sum_k static[k][s_k] + sum_t weights[i][t] * terms[t][1][s_{terms[t][0]}], where a term t with
    conditions[t] = (selector, r) counts only when the selector takes strategy r (a link from the term's key to
    the selector carries it). Weights are never negative."""

    static: dict[str, Sequence[float]]
    terms: list[tuple[str, Sequence[float]]]
    weights: list[dict[int, float]]
    conditions: list[tuple[str, int] | None] = dataclasses.field(default_factory=list)
    # Every row also holds the largest of these buffers (the gradient buckets of each kind of reduction), each
    # a sum over edges of bytes per (source layout, destination layout) pair: `cost` holds bytes.
    buffers: list[list[IlpEdge]] = dataclasses.field(default_factory=list)
    # Terms over an edge's layout pairs (a value's copy redistributed for its reader): an edge whose `cost` holds
    # bytes per (source layout, destination layout) pair; point i holds pair_weights[i][j] of pair term j.
    pairs: list[IlpEdge] = dataclasses.field(default_factory=list)
    pair_weights: list[dict[int, float]] = dataclasses.field(default_factory=list)

    def condition(self, t: int) -> tuple[str, int] | None:
        return self.conditions[t] if self.conditions else None

    def usage(self, choice: dict[str, int]) -> float:
        """The largest row under `choice`."""
        return self.peak({k: {i: 1.0} for k, i in choice.items()})

    def peak(self, x: dict[str, dict[int, float]]) -> float:
        """The largest row at a fractional point: x[key] maps strategies to their weights (a conditional term
        counts at its selector's weight of the condition, a buffer's pair at the product of its ends' weights, as
        if they were independent)."""
        base = sum(sum(w * v[i] for i, w in x[k].items()) for k, v in self.static.items())
        term = []
        for t, (k, b) in enumerate(self.terms):
            c = self.condition(t)
            share = 1.0 if c is None else x[c[0]].get(c[1], 0.0)
            term.append(share * sum(w * b[i] for i, w in x[k].items()))
        buffer = max((sum(_pair_value(e, x) for e in edges) for edges in self.buffers), default=0.0)
        pair = [_pair_value(e, x) for e in self.pairs]
        return base + buffer + max((sum(w * term[t] for t, w in row.items()) + sum(w * pair[j] for j, w in prow.items())
                                    for row, prow in zip(self.weights, self.aligned_pair_weights())), default=0.0)

    def aligned_pair_weights(self) -> list[dict[int, float]]:
        """pair_weights, one (maybe empty) per point."""
        return self.pair_weights or [{} for _ in self.weights]

    def most(self) -> float:
        """The largest any choice's largest row can be: no plan exceeds it."""
        static = sum(max(v, default=0.0) for v in self.static.values())
        most = [max(b, default=0.0) for _, b in self.terms]
        pair = [max(map(max, e.cost)) for e in self.pairs]
        return static + self.most_buffered() + max(
            (sum(w * most[t] for t, w in row.items()) + sum(w * pair[j] for j, w in prow.items())
             for row, prow in zip(self.weights, self.aligned_pair_weights())), default=0.0)

    def most_buffered(self) -> float:
        """The largest any choice's buffers can be."""
        return max((sum(max(map(max, e.cost)) for e in edges) for edges in self.buffers), default=0.0)

    def restricted(self, kept: dict[str, list[int]]) -> "MemoryRows":
        """The rows over the strategies `kept` lists per key; a term conditional on a dropped selector strategy
        goes (no choice can use it)."""
        live, conditions = [], []
        for t in range(len(self.terms)):
            c = self.condition(t)
            if c is not None:
                if c[1] not in kept[c[0]]:
                    continue
                c = (c[0], kept[c[0]].index(c[1]))
            live.append(t)
            conditions.append(c)
        new = {t: i for i, t in enumerate(live)}
        weights = [{new[t]: w for t, w in row.items() if t in new} for row in self.weights]
        return MemoryRows({k: [v[i] for i in kept[k]] for k, v in self.static.items()},
                          [(k, [b[i] for i in kept[k]]) for k, b in (self.terms[t] for t in live)], weights,
                          conditions if self.conditions else [],
                          _restricted_buffers(self.buffers, kept), [e.restricted(kept) for e in self.pairs],
                          self.pair_weights)


def _restricted_buffers(buffers: list[list[IlpEdge]], kept: dict[str, list[int]]) -> list[list[IlpEdge]]:
    """Buffers over the kept strategies; an edge on several buffers stays one object (counted once where the
    buffers are summed)."""
    done: dict[int, IlpEdge] = {}
    return [[done.setdefault(id(e), e.restricted(kept)) for e in edges] for edges in buffers]


def _pair_value(e: IlpEdge, x: dict[str, dict[int, float]]) -> float:
    """An edge's matrix at a fractional point (its ends' weights taken as independent)."""
    if e.dst is None:
        return sum(w * e.cost[e.src_index[i]][0] for i, w in x[e.src].items())
    if e.src == e.dst:
        return sum(w * e.cost[e.src_index[i]][e.dst_index[i]] for i, w in x[e.src].items())
    return sum(w * v * e.cost[e.src_index[i]][e.dst_index[j]] for i, w in x[e.src].items()
               for j, v in x[e.dst].items())


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
    links: list[IlpLink] = dataclasses.field(default_factory=list)
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
        total += sum(ln.cost[choice[ln.key]][choice[ln.selector]] for ln in self.links)
        return total + sum(shared.values())

    def selectors(self) -> set[str]:
        return {ln.selector for ln in self.links}

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
