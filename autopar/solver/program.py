"""The integer program as a sparse matrix, for any backend: x booleans, y/z edge variables, memory rows.

Each backend turns a `Program` into its own model; the layout of the program (which variable and row means
what) lives here once, so HiGHS and CP-SAT solve the same program.
"""
from __future__ import annotations

import dataclasses

from autopar.solver.ilp import IlpEdge, IlpLink, IlpProblem


@dataclasses.dataclass
class Program:
    """min cost . v  subject to  lo <= A v <= hi,  v in [0, 1] (x integer; y integral once x is), except the
    `timed` columns: seconds >= 0, one per (shared redistribution, destination layout), whose rows hold costs
    in seconds rather than 0/1 quantities."""

    x: dict[str, list[int]]  # key -> column of each strategy's boolean
    n_cols: int
    integer: list[bool]
    cost: list[float]  # seconds per column
    rows: list[tuple[float, float, dict[int, float]]]  # (lo, hi, {column: coefficient}), 0/1 quantities
    memory_limit: float | None
    # Memory at candidate point i: static . x + sum_t points[i][t] * (terms[t] . x), in bytes (a term over x, a
    # link's y, or an edge's transportation columns).
    static: dict[int, float] = dataclasses.field(default_factory=dict)
    terms: list[dict[int, float]] = dataclasses.field(default_factory=list)
    points: list[dict[int, float]] = dataclasses.field(default_factory=list)
    # Every point also holds the largest of these buffers (bytes per column; MemoryRows.buffers).
    buffers: list[dict[int, float]] = dataclasses.field(default_factory=list)
    n_edge_vars: int = 0
    links: dict[tuple[str, str], list[list[int]]] = dataclasses.field(default_factory=dict)  # y[s][r] columns
    timed: set[int] = dataclasses.field(default_factory=set)
    timed_rows: dict[int, int] = dataclasses.field(default_factory=dict)  # row -> the timed column it bounds
    # Transportation columns per (source key, destination key, their layout classes): edges alike share them
    # (a quiet axis's rows read the same pairs as the edge's price).
    pairs: dict[tuple, dict[tuple[int, int], dict[int, float]]] = dataclasses.field(default_factory=dict)

    def column(self, integer: bool = False, cost: float = 0.0) -> int:
        self.integer.append(integer)
        self.cost.append(cost)
        self.n_cols += 1
        return self.n_cols - 1

    def columns(self, n: int) -> int:
        """n continuous columns of no cost; the first one's index."""
        self.integer.extend([False] * n)
        self.cost.extend([0.0] * n)
        self.n_cols += n
        return self.n_cols - n


def build_program(p: IlpProblem) -> Program:
    prog = Program({}, 0, [], [], [], p.memory_limit)
    for k in sorted(p.n_strategies):
        prog.x[k] = [prog.column(True, float(c)) for c in p.compute[k]]
        prog.rows.append((1.0, 1.0, {c: 1.0 for c in prog.x[k]}))
    shared: dict[tuple, int] = {}
    for e in p.edges:
        _edge(prog, e, shared)
    for ln in p.links:
        _link(prog, ln)
    if p.quiet_axes:
        _quiet(prog, [e for e in p.edges + p.side_edges if e.contends], p.quiet_axes)
    if p.memory is not None:
        _memory_rows(prog, p)
    return prog


def _quiet(prog: Program, edges: list[IlpEdge], axes: frozenset[int]) -> None:
    """No layout change of these edges may hold a collective on `axes`: the indicators of such pairs are 0."""
    for e in edges:
        uses = [m for ax, m in e.contends.items() if ax in axes]
        if not uses:
            continue
        row: dict[int, float] = {}
        for (a, b), ind in _pair_indicators(prog, e).items():
            if any(m[a][b] for m in uses):
                for col, coef in ind.items():
                    row[col] = row.get(col, 0.0) + coef
        if row:
            prog.rows.append((0.0, 0.0, row))


def _edge(prog: Program, e: IlpEdge, shared: dict[tuple, int]) -> None:
    if all(c == 0 for row in e.cost for c in row):
        return
    indicators = _pair_indicators(prog, e)
    if e.group is None:
        for (a, b), ind in indicators.items():
            c = float(e.cost[a][b])
            for col, coef in ind.items():
                prog.cost[col] += coef * c
        return
    # A shared redistribution pays each destination layout once, at the price from the value's source layout:
    # w[g,b] >= sum_a c[a,b] I_e(a,b) for each edge e of the group (seconds). One row per (edge, destination)
    # rather than per (edge, source, destination) pair keeps the relaxation small; once x is integral only the
    # source layout a chosen is 1, so w[g,b] is c[a,b] when some edge reads b and 0 otherwise.
    rows: dict[int, dict[int, float]] = {}
    for (a, b), ind in indicators.items():
        c = float(e.cost[a][b])
        if c:
            row = rows.setdefault(b, {})
            for col, coef in ind.items():
                row[col] = row.get(col, 0.0) - coef * c
    for b, row in rows.items():
        w = shared.get((e.group, b))
        if w is None:
            w = shared[(e.group, b)] = prog.column(False, 1.0)
            prog.timed.add(w)
            prog.n_edge_vars += 1
        row[w] = 1.0
        prog.timed_rows[len(prog.rows)] = w
        prog.rows.append((0.0, float("inf"), row))


def _pair_indicators(prog: Program, e: IlpEdge) -> dict[tuple[int, int], dict[int, float]]:
    """For each (source layout a, destination layout b) of an edge, a linear expression over columns equal to 1
    exactly when the edge carries a -> b: a sum of x where one side decides, else a transportation y."""
    xs = prog.x[e.src]
    A, B = len(e.cost), len(e.cost[0])
    out: dict[tuple[int, int], dict[int, float]] = {}
    if e.dst is None or B == 1:
        for s, col in enumerate(xs):
            out.setdefault((e.src_index[s], 0), {})[col] = 1.0
        return out
    xd = prog.x[e.dst]
    if e.src == e.dst:
        for s, col in enumerate(xs):
            out.setdefault((e.src_index[s], e.dst_index[s]), {})[col] = 1.0
        return out
    if A == 1:
        for t, col in enumerate(xd):
            out.setdefault((0, e.dst_index[t]), {})[col] = 1.0
        return out
    key = (e.src, e.dst, tuple(e.src_index), tuple(e.dst_index), A, B)
    if key in prog.pairs:
        return prog.pairs[key]
    first = prog.columns(A * B)
    y = [list(range(first + a * B, first + (a + 1) * B)) for a in range(A)]
    prog.n_edge_vars += A * B
    src: list[list[int]] = [[] for _ in range(A)]
    for s, col in enumerate(xs):
        src[e.src_index[s]].append(col)
    dst: list[list[int]] = [[] for _ in range(B)]
    for t, col in enumerate(xd):
        dst[e.dst_index[t]].append(col)
    for a in range(A):
        row = dict.fromkeys(y[a], 1.0)
        row.update(dict.fromkeys(src[a], -1.0))
        prog.rows.append((0.0, 0.0, row))
    for b in range(B):
        row = {y[a][b]: 1.0 for a in range(A)}
        row.update(dict.fromkeys(dst[b], -1.0))
        prog.rows.append((0.0, 0.0, row))
    prog.pairs[key] = {(a, b): {y[a][b]: 1.0} for a in range(A) for b in range(B)}
    return prog.pairs[key]


def _link(prog: Program, ln: IlpLink) -> None:
    """Transportation variables y[s][r] between a key's strategies and its selector's, priced per pair."""
    xs, xr = prog.x[ln.key], prog.x[ln.selector]
    y = [[prog.column(False, float(ln.cost[s][r])) for r in range(len(xr))] for s in range(len(xs))]
    prog.n_edge_vars += len(xs) * len(xr)
    for s, col in enumerate(xs):
        prog.rows.append((0.0, 0.0, {**{y[s][r]: 1.0 for r in range(len(xr))}, col: -1.0}))
    for r, col in enumerate(xr):
        prog.rows.append((0.0, 0.0, {**{y[s][r]: 1.0 for s in range(len(xs))}, col: -1.0}))
    prog.links[(ln.key, ln.selector)] = y


def _memory_rows(prog: Program, p: IlpProblem) -> None:
    mem = p.memory
    for k, v in mem.static.items():
        for col, b in zip(prog.x[k], v):
            if b:
                prog.static[col] = prog.static.get(col, 0.0) + float(b)
    prog.terms = []
    for t, (k, v) in enumerate(mem.terms):
        c = mem.condition(t)
        if c is None:
            prog.terms.append({col: float(b) for col, b in zip(prog.x[k], v) if b})
        else:  # summed over the pairs (s, r) of the link from k to the selector
            y = prog.links[(k, c[0])]
            prog.terms.append({y[s][c[1]]: float(b) for s, b in enumerate(v) if b})
    prog.terms += [_pair_bytes(prog, [e]) for e in mem.pairs]  # summed over the edge's layout pairs
    n = len(mem.terms)
    prog.points = [{**row, **{n + j: w for j, w in prow.items()}}
                   for row, prow in zip(mem.weights, mem.aligned_pair_weights())]
    prog.buffers = [_pair_bytes(prog, edges) for edges in mem.buffers]


def _pair_bytes(prog: Program, edges: list[IlpEdge]) -> dict[int, float]:
    """The bytes `edges` hold (their cost per layout pair) as coefficients over the pairs' indicators."""
    coefs: dict[int, float] = {}
    for e in edges:
        for (a, b), ind in _pair_indicators(prog, e).items():
            if e.cost[a][b]:
                for col, c in ind.items():
                    coefs[col] = coefs.get(col, 0.0) + c * float(e.cost[a][b])
    return coefs


def has_memory(prog: Program) -> bool:
    """Whether the program has memory rows."""
    return bool(prog.static or prog.terms or prog.buffers)


def expanded_memory_rows(prog: Program) -> list[dict[int, float]]:
    """Each candidate point's row over x alone (bytes per column), without the buffers."""
    out = []
    for row in prog.points:
        coefs = dict(prog.static)
        for t, w in row.items():
            for col, b in prog.terms[t].items():
                coefs[col] = coefs.get(col, 0.0) + w * b
        out.append(coefs)
    return out
