"""One entry to the integer program: check the request and hand it to the backend (HiGHS or CP-SAT)."""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

from autopar.errors import SolverTimeout
from autopar.solver.cpsat import solve_cpsat
from autopar.solver.highs import solve_highs
from autopar.solver.ilp import BACKENDS, IlpProblem, IlpResult


def solve(p: IlpProblem, *, backend: str = "highs", deadline: float | None = None, objective: str = "time",
          hint: dict[str, int] | None = None, relative_gap: float = 0.0,
          on_progress: Callable[[str], None] | None = None, restricted: bool = False) -> IlpResult:
    """Solve `p` before `deadline` (time.monotonic() seconds; None: no limit).

    objective "time" minimizes seconds under the memory limit; "peak" minimizes the largest memory row with no
    limit (any one plan of least peak: layout changes are not priced). `hint` is a full choice to start from;
    `relative_gap` lets the solver stop once its incumbent is proven within that fraction of the optimum.
    Raises ProgramInfeasible when nothing fits and SolverTimeout when the deadline passes before any solution is
    found; at the deadline with a solution, returns it with optimal=False. `restricted` says `p` is a small
    program over a few strategies per key (a warm start): HiGHS then branches on pseudo-costs from the first
    node instead of strong branching, does not restart its root and runs no RINS sub-MIPs (1.4-2.5x faster on
    the programs measured, the same optima; docs/solver.md)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown solver backend {backend!r}; use SolverConfig(backend=...) with one of: "
                         + ", ".join(BACKENDS))
    if objective not in ("time", "peak"):
        raise ValueError(f"unknown objective {objective!r}: 'time' or 'peak'")
    remaining = None if deadline is None else deadline - time.monotonic()
    if remaining is not None and remaining <= 0:
        raise SolverTimeout("the time limit was reached before the integer program could start")
    if objective == "peak" and not p.quiet_axes:
        # The peak does not depend on what layout changes cost: the program needs its keys, links and memory
        # rows (a gradient buffer's edges come with MemoryRows.buffers), not a column per edge and layout pair
        # (Llama's joint program at hidden 64: 76k columns, 72 s, against 7k columns, 1.7 s; the same peak).
        p = dataclasses.replace(p, edges=[], side_edges=[])
    if backend == "highs":
        return solve_highs(p, remaining, objective, hint, relative_gap, on_progress, restricted)
    return solve_cpsat(p, remaining, objective, hint, relative_gap, on_progress)
