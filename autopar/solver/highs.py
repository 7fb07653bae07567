"""The HiGHS backend: the program as a MathOpt model proto, solved as a MIP (x boolean, y and z continuous).

MathOpt rather than pywraplp: it passes a start solution to HiGHS and reports HiGHS's proven dual bound, so a
plan stopped early says how far from optimal it can be. Memory rows go through one continuous column per
allocation term (m_t = bytes_t . x) and one for the static state (S = static . x), so a candidate point's row
S + sum_t w[i,t] m_t holds a few dozen entries instead of one per strategy.
"""
from __future__ import annotations

import dataclasses
import datetime
import time
from typing import Callable

from ortools.math_opt import callback_pb2, model_parameters_pb2, model_pb2, parameters_pb2, result_pb2
from ortools.math_opt.core.python import solver as core
from ortools.math_opt.python import init_arguments

from autopar.solver.ilp import (BYTES_PER_HIGHS_MEMORY_UNIT, OPTIMALITY_TOLERANCE, SECONDS_PER_HIGHS_TIME_UNIT,
                                IlpProblem, IlpResult, ProgramInfeasible)
from autopar.errors import SolverTimeout
from autopar.solver.program import Program, build_program, has_memory

_T = result_pb2.TerminationReasonProto
_INF = float("inf")


# HiGHS options for a restricted program (a warm start over a few strategies per key), where the root's strong
# branching, its restart and RINS take most of the time and the optimum is found without them. A warm start is
# a plan, not a proof (its gap is to the whole program's relaxation): its search stops after _WARM_NODES nodes
# (some first warm starts of the small transformers models reach it; T5's second one spent 28 s on 1,523
# nodes proving its start optimal). A HiGHS too old to know one of them (an older ortools) solves with its defaults.
_WARM_NODES = 256
_RESTRICTED = {"mip_pscost_minreliable": 0, "mip_allow_restart": False, "mip_heuristic_run_rins": False,
               "mip_max_nodes": _WARM_NODES}
_restricted_known = True


def solve_highs(p: IlpProblem, remaining: float | None, objective: str, hint: dict[str, int] | None,
                relative_gap: float, on_progress: Callable[[str], None] | None, restricted: bool = False
                ) -> IlpResult:
    t0 = time.perf_counter()
    prog = build_program(p)
    proto = _model(prog, objective)
    params = _params(p.seed, remaining)
    if restricted and _restricted_known:
        for k, v in _RESTRICTED.items():
            (params.highs.bool_options if isinstance(v, bool) else params.highs.int_options)[k] = v
    if relative_gap > 0:
        params.relative_gap_tolerance = relative_gap
    model_params = model_parameters_pb2.ModelSolveParametersProto()
    if hint is not None:
        h = model_params.solution_hints.add()
        for k in sorted(prog.x):
            for i, col in enumerate(prog.x[k]):
                h.variable_values.ids.append(col)
                h.variable_values.values.append(1.0 if hint[k] == i else 0.0)
    build_s = time.perf_counter() - t0
    if on_progress:
        on_progress(f"solving: {prog.n_cols} variables, {len(proto.linear_constraints.ids)} constraints")
    t1 = time.perf_counter()
    try:
        res = _run(proto, params, model_params)
    except Exception as e:  # pybind11_abseil's StatusNotOk: an option this HiGHS does not know
        if not (restricted and _restricted_known and "option name was unknown" in str(e)):
            raise
        _forget_restricted()
        params.highs.Clear()
        res = _run(proto, params, model_params)
    solve_s = time.perf_counter() - t1
    val = _check(res)
    choice = {k: max(range(len(cols)), key=lambda i: (val.get(cols[i], 0.0), -i)) for k, cols in prog.x.items()}
    unit = SECONDS_PER_HIGHS_TIME_UNIT if objective == "time" else BYTES_PER_HIGHS_MEMORY_UNIT
    reason = res.termination.reason
    bounds = res.termination.objective_bounds
    obj = bounds.primal_bound * unit
    bound = max(min(bounds.dual_bound, bounds.primal_bound), 0.0) * unit
    optimal = reason == _T.TERMINATION_REASON_OPTIMAL and obj - bound <= OPTIMALITY_TOLERANCE * obj
    stats = {"backend": "highs", "variables": prog.n_cols, "keys": len(prog.x), "edge_variables": prog.n_edge_vars,
             "constraints": len(proto.linear_constraints.ids), "memory_points": len(prog.points),
             "status": "OPTIMAL" if reason == _T.TERMINATION_REASON_OPTIMAL else "FEASIBLE",
             "nodes": res.solve_stats.node_count, "build_seconds": build_s, "solve_seconds": solve_s}
    return IlpResult(choice, obj, bound, optimal, stats)


def _forget_restricted() -> None:
    global _restricted_known
    _restricted_known = False


# Relaxations with candidate points' memory rows and more columns than this are solved by HiGHS's interior
# point method (with crossover to a vertex, so the support and the shadow prices are a basic solution's): memory
# rows take away the network structure dual simplex is quick on. Measured on this project's programs (one core):
# Qwen2 at hidden 64 on 2x2 at 0.3x its peak (77k columns) 7.2 s against 15.8 s by dual simplex, the hf Llama
# 6.4 against 8.5 s (77k), T5 36.6 against 51.6 s (246k); but Llama-3-70B on 8x8 at 0.7x (54k) 4.6 against 1.1 s,
# GPT-NeoX at 0.5x (57k) 3.4 against 2.2 s, GPT-2 at 0.7x (34k) 0.73 against 0.28 s. Size is a rough guide (the
# threshold sits between the programs measured); without those rows simplex is faster at every size (T5: 4.7
# against 13.2 s).
_IPM_COLUMNS = 70_000


def relaxation_highs(p: IlpProblem, remaining: float | None, iteration_limit: int | None = None
                     ) -> tuple[float, dict[str, list[float]], dict]:
    """The relaxation: (its optimum in seconds, a lower bound on the program's; x per key; the program's size).
    With memory rows, size["memory_prices"] holds each candidate point's shadow price (seconds per byte), and
    size["iterations"] and size["barrier_iterations"] the simplex and interior point iterations it took. With
    `iteration_limit` (simplex iterations), a relaxation not solved within them raises SolverTimeout (a
    deterministic cap, unlike a time limit), and is solved by dual simplex at any size."""
    t0 = time.perf_counter()
    prog = build_program(p)
    proto = _relaxed(_model(prog, "time"))
    t1 = time.perf_counter()
    params = _params(p.seed, remaining)
    if iteration_limit is not None:
        params.highs.int_options["simplex_iteration_limit"] = iteration_limit
    elif has_memory(prog) and prog.points and prog.n_cols > _IPM_COLUMNS:  # some candidate point's row
        params.highs.string_options["solver"] = "ipm"
    res = _run(proto, params, model_parameters_pb2.ModelSolveParametersProto())
    val = _check(res)
    if iteration_limit is not None and res.termination.reason != _T.TERMINATION_REASON_OPTIMAL:
        raise SolverTimeout(f"the relaxation was not solved within {iteration_limit} simplex iterations")
    x = {k: [val.get(c, 0.0) for c in cols] for k, cols in prog.x.items()}
    n_points = len(prog.points) if has_memory(prog) else 0
    duals = res.solutions[0].dual_solution.dual_values
    dual = dict(zip(duals.ids, duals.values))
    rows = len(proto.linear_constraints.ids)
    # The point rows come last (_model); a binding <= row of a minimization has a dual <= 0.
    prices = [max(-dual.get(r, 0.0), 0.0) * SECONDS_PER_HIGHS_TIME_UNIT / BYTES_PER_HIGHS_MEMORY_UNIT
              for r in range(rows - n_points, rows)]
    size = {"memory_prices": prices, "iterations": res.solve_stats.simplex_iterations, "variables": prog.n_cols,
            "barrier_iterations": res.solve_stats.barrier_iterations, "keys": len(prog.x),
            "edge_variables": prog.n_edge_vars,
            "constraints": len(proto.linear_constraints.ids), "memory_points": len(prog.points),
            "build_seconds": t1 - t0, "solve_seconds": time.perf_counter() - t1}
    return res.termination.objective_bounds.dual_bound * SECONDS_PER_HIGHS_TIME_UNIT, x, size


def peak_relaxation(p: IlpProblem, remaining: float | None) -> float:
    """A lower bound on any plan's peak in bytes: the relaxation of the program minimizing the largest memory
    row. It has no edges (a gradient buffer's come with the memory rows) and leaves out the redistributed
    copies' terms (never negative: still a lower bound), so it is small; where it exceeds the limit, the
    relaxation with memory rows is infeasible too, and so is the program."""
    memory = None if p.memory is None else dataclasses.replace(p.memory, pairs=[], pair_weights=[])
    prog = build_program(dataclasses.replace(p, edges=[], side_edges=[], memory_limit=None, memory=memory))
    proto = _relaxed(_model(prog, "peak"))
    res = _run(proto, _params(p.seed, remaining), model_parameters_pb2.ModelSolveParametersProto())
    _check(res)
    return res.termination.objective_bounds.dual_bound * BYTES_PER_HIGHS_MEMORY_UNIT


def _relaxed(proto: model_pb2.ModelProto) -> model_pb2.ModelProto:
    """The program's proto with every column continuous."""
    del proto.variables.integers[:]
    proto.variables.integers.extend([False] * len(proto.variables.ids))
    return proto


def _params(seed: int, remaining: float | None) -> parameters_pb2.SolveParametersProto:
    # HiGHS runs its MIP search on one thread and is deterministic at a fixed seed.
    params = parameters_pb2.SolveParametersProto(random_seed=seed, enable_output=False)
    if remaining is not None:
        params.time_limit.FromTimedelta(datetime.timedelta(seconds=max(remaining, 1e-3)))
    return params


def _run(proto, params, model_params):
    init = init_arguments.StreamableSolverInitArguments().to_proto()
    return core.solve(proto, parameters_pb2.SOLVER_TYPE_HIGHS, init, params, model_params, None,
                      callback_pb2.CallbackRegistrationProto(), None, None)


def _check(res) -> dict[int, float]:
    """Column values of the solution; the shared errors when there is none."""
    reason = res.termination.reason
    if reason in (_T.TERMINATION_REASON_INFEASIBLE, _T.TERMINATION_REASON_INFEASIBLE_OR_UNBOUNDED):
        raise ProgramInfeasible("no choice of strategies satisfies the memory rows")
    if not res.solutions or reason not in (_T.TERMINATION_REASON_OPTIMAL, _T.TERMINATION_REASON_FEASIBLE):
        raise SolverTimeout(f"HiGHS stopped without a solution ({res.termination.detail or reason})")
    values = res.solutions[0].primal_solution.variable_values
    return dict(zip(values.ids, values.values))


def _model(prog: Program, objective: str) -> model_pb2.ModelProto:
    """The program as a proto; with objective 'peak', one more column bounds every memory row and is minimized."""
    cols_lb = [0.0] * prog.n_cols
    cols_ub = [_INF if c in prog.timed else 1.0 for c in range(prog.n_cols)]
    integer = list(prog.integer)
    # A timed column holds milliseconds here (seconds in the Program): its rows' other coefficients are costs.
    tu = SECONDS_PER_HIGHS_TIME_UNIT
    cost = [(c if i in prog.timed else c / tu) for i, c in enumerate(prog.cost)] if objective == "time" \
        else [0.0] * prog.n_cols
    rows = list(prog.rows)  # read, not changed: the rows below are new
    for i, w in prog.timed_rows.items():  # a timed column's row: the others' coefficients are seconds
        lo, hi, r = rows[i]
        row = {c: v / tu for c, v in r.items()}
        row[w] = r[w]
        rows[i] = (lo, hi, row)
    peak_col = None
    if has_memory(prog):
        u = BYTES_PER_HIGHS_MEMORY_UNIT

        def aux(coefs: dict[int, float]) -> int:
            col = len(cols_lb)
            cols_lb.append(0.0)
            cols_ub.append(_INF)
            integer.append(False)
            cost.append(0.0)
            row = {c: -b / u for c, b in coefs.items()}
            row[col] = 1.0
            rows.append((0.0, 0.0, row))
            return col

        static = aux(prog.static)
        terms = [aux(t) for t in prog.terms]
        buffer = None
        if prog.buffers:  # B >= each buffer; every point holds B
            buffer = len(cols_lb)
            cols_lb.append(0.0)
            cols_ub.append(_INF)
            integer.append(False)
            cost.append(0.0)
            for coefs in prog.buffers:
                row = {c: -b / u for c, b in coefs.items()}
                row[buffer] = 1.0
                rows.append((0.0, _INF, row))
        limit = _INF if objective == "peak" or prog.memory_limit is None else prog.memory_limit / u
        if objective == "peak":
            peak_col = len(cols_lb)
            cols_lb.append(0.0)
            cols_ub.append(_INF)
            integer.append(False)
            cost.append(1.0)
        for point in prog.points or [{}]:
            row = {static: 1.0} if buffer is None else {static: 1.0, buffer: 1.0}
            for t, w in point.items():
                row[terms[t]] = row.get(terms[t], 0.0) + w
            if peak_col is not None:
                row[peak_col] = -1.0
                rows.append((-_INF, 0.0, row))
            else:
                rows.append((-_INF, limit, row))
    m = model_pb2.ModelProto()
    n = len(cols_lb)
    m.variables.ids.extend(range(n))
    m.variables.lower_bounds.extend(cols_lb)
    m.variables.upper_bounds.extend(cols_ub)
    m.variables.integers.extend(integer)
    nz = [(i, c) for i, c in enumerate(cost) if c]
    m.objective.linear_coefficients.ids.extend(i for i, _ in nz)
    m.objective.linear_coefficients.values.extend(c for _, c in nz)
    m.linear_constraints.ids.extend(range(len(rows)))
    m.linear_constraints.lower_bounds.extend(lo for lo, _, _ in rows)
    m.linear_constraints.upper_bounds.extend(hi for _, hi, _ in rows)
    # The matrix in row-major order, column ids ascending within a row (MathOpt's rule), each field extended once.
    row_ids: list[int] = []
    col_ids: list[int] = []
    values: list[float] = []
    for r, (_, _, coefs) in enumerate(rows):
        entries = sorted(kv for kv in coefs.items() if kv[1])
        row_ids.extend([r] * len(entries))
        col_ids.extend([c for c, _ in entries])
        values.extend([v for _, v in entries])
    mat = m.linear_constraint_matrix
    mat.row_ids.extend(row_ids)
    mat.column_ids.extend(col_ids)
    mat.coefficients.extend(values)
    return m
