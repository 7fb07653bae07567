"""Choose one strategy per plan key minimizing compute + resharding time under a per-rank memory bound.

The math. For every key k with strategies S_k there are booleans x[k,s], sum_s x[k,s] = 1. An edge e from
key u (output layouts A_e, strategy s maps to a(s)) to key v (input layouts B_e, strategy t maps to b(t)) with
cost c_e[a,b] adds booleans y[e,a,b] tied to x by transportation constraints

    sum_b y[e,a,b] = sum_{s: a(s)=a} x[u,s]        sum_a y[e,a,b] = sum_{t: b(t)=b} x[v,t]

so y[e,a,b] = 1 exactly when u outputs a and v wants b. Edges whose cost depends on one side only, or whose
two ends share a key, are linear in x and need no y. The objective is

    min  sum_{k,s} compute[k,s] x[k,s]  +  sum_{e,a,b} c_e[a,b] y[e,a,b]

subject to  sum_{k,s} memory[k,s] x[k,s] <= limit  (parameter state + activations saved for backward).
Keys of repeated layers are shared, so one block's variables stand for every layer (costs carry the repeat
count). The default backend is HiGHS (a MIP: x boolean, y continuous, since the transportation constraints
make y integral once x is); the "cp-sat" backend keeps every variable boolean with integer nanosecond costs.
Both create variables in sorted key order and run deterministically, so the same inputs give the same plan.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

from ortools.sat.python import cp_model

SCALE = 1e9  # seconds -> integer nanoseconds


class SolverTimeout(ValueError):
    """No feasible plan was found before the time limit."""


@dataclasses.dataclass
class IlpEdge:
    src: str
    dst: str | None  # None: fixed destination (one layout)
    src_index: Sequence[int]
    dst_index: Sequence[int] | None
    cost: Sequence[Sequence[float]]


@dataclasses.dataclass
class IlpProblem:
    n_strategies: dict[str, int]
    compute: dict[str, Sequence[float]]
    memory: dict[str, Sequence[float]]
    edges: list[IlpEdge]
    memory_limit: float | None
    time_limit_s: float = 60.0
    seed: int = 0
    workers: int = 1
    fixed_memory: float = 0.0


@dataclasses.dataclass
class IlpResult:
    choice: dict[str, int]
    objective_s: float
    optimal: bool
    stats: dict


def _ns(x: float) -> int:
    return int(round(x * SCALE))


def solve(p: IlpProblem, on_progress: Callable[[str], None] | None = None, minimize_memory: bool = False,
          backend: str = "highs") -> IlpResult | None:
    """Solve; None when infeasible. With minimize_memory the objective is memory alone and no limit applies.

    backend "highs" (default) is a MIP over boolean x with continuous y (the transportation constraints make
    y integral once x is); "cp-sat" keeps every variable boolean."""
    if backend == "highs":
        return _solve_mip(p, on_progress, minimize_memory)
    t0 = time.perf_counter()
    m = cp_model.CpModel()
    x: dict[str, list] = {}
    for k in sorted(p.n_strategies):
        n = p.n_strategies[k]
        x[k] = [m.NewBoolVar(f"x[{k},{i}]") for i in range(n)]
        m.AddExactlyOne(x[k])
    obj: list = []
    n_y = 0
    if not minimize_memory:
        for k in sorted(x):
            obj.extend(_ns(c) * v for c, v in zip(p.compute[k], x[k]) if _ns(c))
        for e in p.edges:
            n_y += _add_edge(m, e, x, obj)
    mem_terms = [int(c) * v for k in sorted(p.memory) for c, v in zip(p.memory[k], x[k]) if int(c)]
    if minimize_memory:
        obj = mem_terms
    elif p.memory_limit is not None and mem_terms:
        m.Add(sum(mem_terms) <= int(p.memory_limit - p.fixed_memory))
    m.Minimize(sum(obj) if obj else 0)
    build_s = time.perf_counter() - t0
    solver = cp_model.CpSolver()
    prm = solver.parameters
    prm.random_seed = p.seed
    prm.num_workers = p.workers
    prm.max_deterministic_time = p.time_limit_s
    prm.log_search_progress = False
    cb = _Progress(on_progress, t0) if on_progress else None
    status = solver.Solve(m, cb) if cb else solver.Solve(m)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    choice = {k: next(i for i, v in enumerate(vs) if solver.BooleanValue(v)) for k, vs in x.items()}
    stats = {"variables": sum(len(v) for v in x.values()) + n_y, "keys": len(x), "edge_variables": n_y,
             "constraints": len(m.Proto().constraints), "build_seconds": build_s,
             "solve_seconds": solver.WallTime(), "status": solver.StatusName(status)}
    return IlpResult(choice, solver.ObjectiveValue() / SCALE, status == cp_model.OPTIMAL, stats)


def _add_edge(m: cp_model.CpModel, e: IlpEdge, x: dict, obj: list) -> int:
    A, B = len(e.cost), len(e.cost[0])
    if all(_ns(c) == 0 for row in e.cost for c in row):
        return 0
    xs = x[e.src]
    if e.dst is None:
        obj.extend(_ns(e.cost[e.src_index[s]][0]) * xs[s] for s in range(len(xs)))
        return 0
    xd = x[e.dst]
    if e.src == e.dst:  # a layer feeding the same op of the next layer: one shared choice
        obj.extend(_ns(e.cost[e.src_index[s]][e.dst_index[s]]) * xs[s] for s in range(len(xs)))
        return 0
    if A == 1 or B == 1:
        obj.extend(_ns(e.cost[0][e.dst_index[t]]) * xd[t] for t in range(len(xd)) if A == 1)
        obj.extend(_ns(e.cost[e.src_index[s]][0]) * xs[s] for s in range(len(xs)) if A != 1)
        return 0
    y = [[m.NewBoolVar("") for _ in range(B)] for _ in range(A)]
    for a in range(A):
        m.Add(sum(y[a]) == sum(xs[s] for s in range(len(xs)) if e.src_index[s] == a))
    for b in range(B):
        m.Add(sum(y[a][b] for a in range(A)) == sum(xd[t] for t in range(len(xd)) if e.dst_index[t] == b))
    obj.extend(_ns(e.cost[a][b]) * y[a][b] for a in range(A) for b in range(B) if _ns(e.cost[a][b]))
    return A * B


class _Progress(cp_model.CpSolverSolutionCallback):
    def __init__(self, report: Callable[[str], None], t0: float):
        super().__init__()
        self.report, self.t0, self.n = report, t0, 0

    def on_solution_callback(self) -> None:
        self.n += 1
        self.report(f"solution {self.n}: objective {self.ObjectiveValue() / SCALE * 1e3:.3f} ms, "
                    f"bound {self.BestObjectiveBound() / SCALE * 1e3:.3f} ms")


def _solve_mip(p: IlpProblem, on_progress, minimize_memory: bool) -> IlpResult | None:
    from ortools.linear_solver import pywraplp

    t0 = time.perf_counter()
    m = pywraplp.Solver.CreateSolver("HIGHS")
    m.SuppressOutput()
    x: dict[str, list] = {}
    obj = m.Objective()
    for k in sorted(p.n_strategies):
        x[k] = [m.BoolVar(f"x{len(x)}_{i}") for i in range(p.n_strategies[k])]
        c = m.Constraint(1, 1)
        for v in x[k]:
            c.SetCoefficient(v, 1)
    lin: dict = {}

    def add(v, coef):
        lin[v] = lin.get(v, 0.0) + coef

    n_y = 0
    if minimize_memory:
        for k in p.memory:
            for c, v in zip(p.memory[k], x[k]):
                add(v, c / 2**30)
    else:
        for k in x:
            for c, v in zip(p.compute[k], x[k]):
                if c:
                    add(v, c * 1e3)
        for e in p.edges:
            n_y += _mip_edge(m, e, x, add)
        mem = [(c, v) for k in p.memory for c, v in zip(p.memory[k], x[k]) if c]
        if p.memory_limit is not None and mem:
            con = m.Constraint(-m.infinity(), (p.memory_limit - p.fixed_memory) / 2**20)
            for c, v in mem:
                con.SetCoefficient(v, c / 2**20)
    for v, coef in lin.items():
        obj.SetCoefficient(v, coef)
    obj.SetMinimization()
    m.SetTimeLimit(int(p.time_limit_s * 1000))
    # HiGHS is deterministic at its default seed; the one option set here silences its banner.
    m.SetSolverSpecificParametersAsString("output_flag = false")
    build_s = time.perf_counter() - t0
    if on_progress:
        on_progress(f"solving: {m.NumVariables()} variables, {m.NumConstraints()} constraints")
    t1 = time.perf_counter()
    status = m.Solve()
    solve_s = time.perf_counter() - t1
    if status == pywraplp.Solver.INFEASIBLE:
        return None
    if status not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        raise SolverTimeout(f"the solver found no plan within its time limit of {p.time_limit_s} s; raise "
                            "Config(solver_time_limit_s=...)")
    choice = {k: max(range(len(vs)), key=lambda i: (vs[i].solution_value(), -i)) for k, vs in x.items()}
    stats = {"variables": m.NumVariables(), "keys": len(x), "edge_variables": n_y,
             "constraints": m.NumConstraints(), "build_seconds": build_s, "solve_seconds": solve_s,
             "status": "OPTIMAL" if status == pywraplp.Solver.OPTIMAL else "FEASIBLE", "backend": "highs"}
    value = obj.Value() / 1e3 if not minimize_memory else obj.Value()
    return IlpResult(choice, value, status == pywraplp.Solver.OPTIMAL, stats)


def _mip_edge(m, e: IlpEdge, x: dict, add) -> int:
    A, B = len(e.cost), len(e.cost[0])
    if all(c == 0 for row in e.cost for c in row):
        return 0
    xs = x[e.src]
    if e.dst is None:
        for s in range(len(xs)):
            add(xs[s], e.cost[e.src_index[s]][0] * 1e3)
        return 0
    xd = x[e.dst]
    if e.src == e.dst:
        for s in range(len(xs)):
            add(xs[s], e.cost[e.src_index[s]][e.dst_index[s]] * 1e3)
        return 0
    if A == 1:
        for t in range(len(xd)):
            add(xd[t], e.cost[0][e.dst_index[t]] * 1e3)
        return 0
    if B == 1:
        for s in range(len(xs)):
            add(xs[s], e.cost[e.src_index[s]][0] * 1e3)
        return 0
    y = [[m.NumVar(0, 1, "") for _ in range(B)] for _ in range(A)]
    for a in range(A):
        c = m.Constraint(0, 0)
        for b in range(B):
            c.SetCoefficient(y[a][b], 1)
        for s in range(len(xs)):
            if e.src_index[s] == a:
                c.SetCoefficient(xs[s], -1)
    for b in range(B):
        c = m.Constraint(0, 0)
        for a in range(A):
            c.SetCoefficient(y[a][b], 1)
        for t in range(len(xd)):
            if e.dst_index[t] == b:
                c.SetCoefficient(xd[t], -1)
    for a in range(A):
        for b in range(B):
            if e.cost[a][b]:
                add(y[a][b], e.cost[a][b] * 1e3)
    return A * B
