"""The program's relaxations (every column continuous), solved by GLOP's dual simplex.

They are the same MathOpt protos the HiGHS backend solves as MIPs (highs._model), handed to GLOP instead: on the
joint programs of the small transformers models at their memory limits its dual simplex took 0.45-0.65x HiGHS's
time to the same optima (the hf Llama at 0.5x: 5.9 against 11.9 s; T5: 48 against 100 s), the relaxations
without memory rows 0.55-0.75x; Llama-3-8B's at its smallest peak 0.96 against 0.61 s (docs/solver.md). GLOP is
deterministic and returns a vertex, so the support of a solution is a few strategies per key and an integral
one is a plan.
"""
from __future__ import annotations

import dataclasses
import datetime
import time

from ortools.math_opt import callback_pb2, model_parameters_pb2, parameters_pb2
from ortools.math_opt.core.python import solver as core
from ortools.math_opt.python import init_arguments

from autopar.solver.highs import _check, _model, _relaxed
from autopar.solver.ilp import (BYTES_PER_HIGHS_MEMORY_UNIT, SECONDS_PER_HIGHS_TIME_UNIT, IlpProblem)
from autopar.solver.program import build_program, has_memory

_SOLVER = parameters_pb2.SOLVER_TYPE_GLOP


def relaxation(p: IlpProblem, remaining: float | None) -> tuple[float, dict[str, list[float]], dict]:
    """The relaxation: (its optimum in seconds, a lower bound on the program's; x per key; the program's size).
    With memory rows, size["memory_prices"] holds each candidate point's shadow price (seconds per byte)."""
    t0 = time.perf_counter()
    prog = build_program(p)
    proto = _relaxed(_model(prog, "time"))
    t1 = time.perf_counter()
    res = _solve(proto, p.seed, remaining)
    val = _check(res)
    x = {k: [val.get(c, 0.0) for c in cols] for k, cols in prog.x.items()}
    n_points = len(prog.points) if has_memory(prog) else 0
    duals = res.solutions[0].dual_solution.dual_values
    dual = dict(zip(duals.ids, duals.values))
    rows = len(proto.linear_constraints.ids)
    # The point rows come last (highs._model); a binding <= row of a minimization has a dual <= 0.
    prices = [max(-dual.get(r, 0.0), 0.0) * SECONDS_PER_HIGHS_TIME_UNIT / BYTES_PER_HIGHS_MEMORY_UNIT
              for r in range(rows - n_points, rows)]
    size = {"memory_prices": prices, "variables": prog.n_cols, "keys": len(prog.x), "edge_variables": prog.n_edge_vars,
            "constraints": len(proto.linear_constraints.ids), "memory_points": len(prog.points),
            "build_seconds": t1 - t0, "solve_seconds": time.perf_counter() - t1}
    return res.termination.objective_bounds.dual_bound * SECONDS_PER_HIGHS_TIME_UNIT, x, size


def peak_relaxation(p: IlpProblem, remaining: float | None) -> float:
    """A lower bound on any plan's peak in bytes: the relaxation of the program minimizing the largest memory
    row. It has no edges (a gradient buffer's come with the memory rows), so it is small; where it exceeds the
    limit, the relaxation with memory rows is infeasible too, and so is the program."""
    prog = build_program(dataclasses.replace(p, edges=[], side_edges=[], memory_limit=None))
    res = _solve(_relaxed(_model(prog, "peak")), p.seed, remaining)
    _check(res)
    return res.termination.objective_bounds.dual_bound * BYTES_PER_HIGHS_MEMORY_UNIT


def _solve(proto, seed: int, remaining: float | None):
    params = parameters_pb2.SolveParametersProto(random_seed=seed, enable_output=False,
                                                 lp_algorithm=parameters_pb2.LP_ALGORITHM_DUAL_SIMPLEX)
    if remaining is not None:
        params.time_limit.FromTimedelta(datetime.timedelta(seconds=max(remaining, 1e-3)))
    return core.solve(proto, _SOLVER, init_arguments.StreamableSolverInitArguments().to_proto(), params,
                      model_parameters_pb2.ModelSolveParametersProto(), None, callback_pb2.CallbackRegistrationProto(),
                      None, None)
