"""The CP-SAT backend: the same program with every variable boolean (but the timed columns, integer nanoseconds),
integer nanosecond costs and integer byte memory rows (rounded up, so a CP-SAT plan never exceeds the limit by
rounding)."""
from __future__ import annotations

import math
import time
from typing import Callable

from ortools.sat.python import cp_model

from autopar.solver.ilp import (BYTES_PER_CPSAT_MEMORY_UNIT, OPTIMALITY_TOLERANCE, SECONDS_PER_CPSAT_TIME_UNIT,
                                IlpProblem, IlpResult, ProgramInfeasible)
from autopar.errors import SolverTimeout
from autopar.solver.program import build_program, expanded_memory_rows, has_memory


def solve_cpsat(p: IlpProblem, remaining: float | None, objective: str, hint: dict[str, int] | None,
                relative_gap: float, on_progress: Callable[[str], None] | None) -> IlpResult:
    t0 = time.perf_counter()
    prog = build_program(p)
    m = cp_model.CpModel()
    unit = SECONDS_PER_CPSAT_TIME_UNIT
    # A timed column is an integer count of nanoseconds; its rows' other coefficients are costs, in nanoseconds
    # rounded as the objective's are.
    top = {}
    for _, _, row in prog.rows:
        for col in prog.timed.intersection(row):
            top[col] = max(top.get(col, 0), sum(abs(round(c / unit)) for c2, c in row.items() if c2 != col))
    v = [m.NewIntVar(0, top.get(i, 0), f"t{i}") if i in prog.timed else m.NewBoolVar(f"v{i}")
         for i in range(prog.n_cols)]
    for lo, hi, row in prog.rows:
        timed = prog.timed.intersection(row)
        expr = sum((int(c) if not timed or col in timed else round(c / unit)) * v[col] for col, c in row.items())
        if lo == hi:
            m.Add(expr == int(lo))
        elif math.isinf(hi):
            m.Add(expr >= int(lo))
        else:
            m.Add(expr <= int(hi))
    mem_rows = [sum(math.ceil(b / BYTES_PER_CPSAT_MEMORY_UNIT) * v[col] for col, b in row.items())
                for row in expanded_memory_rows(prog) or [dict(prog.static)]] if has_memory(prog) else []
    buffer_top = 0
    if prog.buffers:  # every row holds the largest buffer
        rounded = [{col: math.ceil(b / BYTES_PER_CPSAT_MEMORY_UNIT) for col, b in coefs.items()}
                   for coefs in prog.buffers]
        buffer_top = max(sum(r.values()) for r in rounded)
        buffer = m.NewIntVar(0, buffer_top, "buffer")
        for r in rounded:
            m.Add(buffer >= sum(c * v[col] for col, c in r.items()))
        mem_rows = [expr + buffer for expr in mem_rows]
    if objective == "peak":
        bound = sum(max(math.ceil(b / BYTES_PER_CPSAT_MEMORY_UNIT) for b in row.values()) if row else 0
                    for row in expanded_memory_rows(prog)) + buffer_top + 1
        peak = m.NewIntVar(0, bound, "peak")
        for expr in mem_rows:
            m.Add(expr <= peak)
        m.Minimize(peak)
    else:
        if prog.memory_limit is not None:
            for expr in mem_rows:
                m.Add(expr <= int(prog.memory_limit // BYTES_PER_CPSAT_MEMORY_UNIT))
        m.Minimize(sum((round(c) if i in prog.timed else round(c / unit)) * v[i] for i, c in enumerate(prog.cost)
                       if round(c if i in prog.timed else c / unit)))
    if hint is not None:
        for k, cols in prog.x.items():
            for i, col in enumerate(cols):
                m.AddHint(v[col], hint[k] == i)
    build_s = time.perf_counter() - t0
    solver = cp_model.CpSolver()
    prm = solver.parameters
    prm.random_seed = p.seed
    prm.num_workers = p.workers
    if remaining is not None:
        prm.max_time_in_seconds = max(remaining, 1e-3)
    if relative_gap > 0:
        prm.relative_gap_limit = relative_gap
    status = solver.Solve(m, _Progress(on_progress, objective) if on_progress else None)
    if status == cp_model.INFEASIBLE:
        raise ProgramInfeasible("no choice of strategies satisfies the memory rows")
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise SolverTimeout(f"CP-SAT stopped without a solution ({solver.StatusName(status)})")
    choice = {k: next(i for i, col in enumerate(cols) if solver.BooleanValue(v[col])) for k, cols in prog.x.items()}
    unit = SECONDS_PER_CPSAT_TIME_UNIT if objective == "time" else BYTES_PER_CPSAT_MEMORY_UNIT
    obj = solver.ObjectiveValue() * unit
    bound = min(solver.BestObjectiveBound() * unit, obj)
    optimal = status == cp_model.OPTIMAL and obj - bound <= OPTIMALITY_TOLERANCE * obj
    stats = {"backend": "cp-sat", "variables": prog.n_cols, "keys": len(prog.x), "edge_variables": prog.n_edge_vars,
             "constraints": len(m.Proto().constraints), "memory_points": len(prog.points),
             "status": solver.StatusName(status), "build_seconds": build_s, "solve_seconds": solver.WallTime()}
    return IlpResult(choice, obj, bound, optimal, stats)


class _Progress(cp_model.CpSolverSolutionCallback):
    def __init__(self, report: Callable[[str], None], objective: str):
        super().__init__()
        self.report, self.n = report, 0
        self.unit = SECONDS_PER_CPSAT_TIME_UNIT * 1e3 if objective == "time" else 1.0

    def on_solution_callback(self) -> None:
        self.n += 1
        self.report(f"solution {self.n}: objective {self.ObjectiveValue() * self.unit:.6g}, "
                    f"bound {self.BestObjectiveBound() * self.unit:.6g}")
