"""Solve the placement program under a memory bound fast, and say how far from optimal the answer may be.

1. Solve the linear relaxation, memory rows included. Its optimum is a lower bound on the program's; when the
   relaxation is infeasible no plan fits (a fast verdict); when its solution is integral, it is the optimal plan
   (the usual case when the memory limit does not bind: without memory rows the relaxation of this program is
   almost always integral).
2. When no memory row is tight in the relaxation, the limit does not shape the optimum: solve the program to
   optimality, as without a limit.
3. Otherwise the limit binds, and the relaxation mixes sharded and replicated strategies fractionally. Solve the
   program restricted to the strategies the relaxation uses (a small program, quick; RENS in the MIP
   literature): its plan is the warm start. If it is already within `relative_gap` of the relaxation's bound,
   stop there.
4. Else solve the whole program from that start, stopping once the plan is proven within `relative_gap`.

The result carries the best proven bound, so a plan stopped at the gap reports how far from optimal it may be.
Branch and bound closes the last few percent of a binding memory row only slowly, and that proof is what the
gap tolerance skips. Every step is deterministic: the same inputs give the same plan unless the deadline passes.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

from autopar.errors import SolverTimeout
from autopar.solver.ilp import IlpEdge, IlpProblem, IlpResult, ProgramInfeasible, solve

_SUPPORT = 1e-6  # relaxation values above this count as used (and below 1 - this as fractional)
_TIGHTER = 0.9  # the second relaxation's memory limit, as a fraction of the real one


@dataclasses.dataclass
class Bounded:
    result: IlpResult
    path: str  # how the plan was found
    timed_out: bool  # the deadline stopped the search: the plan is the best found, not proven within the gap


class _Tracker:
    """The smallest peak of any choice met on the way, for the time-out message."""

    def __init__(self, p: IlpProblem):
        self.p, self.smallest = p, None

    def see(self, choice: dict[str, int]) -> None:
        if self.p.memory is not None:
            peak = self.p.memory.usage(choice)
            self.smallest = peak if self.smallest is None else min(self.smallest, peak)


def solve_bounded(p: IlpProblem, *, backend: str, deadline: float | None, relative_gap: float,
                  on_progress: Callable[[str], None] | None = None) -> Bounded:
    from autopar.solver.highs import relaxation_highs

    seen, timings = _Tracker(p), {}
    t = time.perf_counter()
    try:
        lb, x = relaxation_highs(p, _remaining(deadline))
    except SolverTimeout as e:
        raise _timeout(e, seen) from None
    timings["relaxation_seconds"] = time.perf_counter() - t
    if all(max(v) > 1 - _SUPPORT for v in x.values()):
        choice = {k: max(range(len(v)), key=v.__getitem__) for k, v in x.items()}
        stats = {"backend": backend, "keys": len(x), "status": "OPTIMAL", "relaxation": "integral"}
        return Bounded(IlpResult(choice, p.objective(choice), lb, True, dict(stats, **timings)),
                       "relaxation integral", False)
    binding = p.memory is not None and p.memory_limit is not None and p.memory.peak(
        {k: {i: w for i, w in enumerate(v) if w > _SUPPORT} for k, v in x.items()}) >= p.memory_limit * (1 - 1e-9)
    if not binding:
        return _search(p, None, 0.0, lb, backend, deadline, seen, timings, on_progress, "memory not binding")
    if on_progress:
        on_progress("memory limit binds: warm start from the relaxation")
    t = time.perf_counter()
    keep = _union(_support(x), _least_static(p))
    start = _warm_start(p, keep, backend, deadline, seen)
    if not _within(start, lb, relative_gap / 2):
        # The relaxation fills the limit exactly by mixing strategies; a plan needs room to spare, so add the
        # strategies the relaxation uses under a tighter limit.
        try:
            _, x2 = relaxation_highs(dataclasses.replace(p, memory_limit=p.memory_limit * _TIGHTER),
                                     _remaining(deadline))
            second = _warm_start(p, _union(keep, _support(x2)), backend, deadline, seen)
            if second is not None and (start is None or second.objective_s < start.objective_s):
                start = second
        except (ProgramInfeasible, SolverTimeout):
            pass
    timings["warm_start_seconds"] = time.perf_counter() - t
    if _within(start, lb, relative_gap):
        r = dataclasses.replace(start, bound_s=lb, optimal=start.objective_s - lb <= 1e-4 * start.objective_s)
        r.stats.update(timings, status="OPTIMAL")
        return Bounded(r, "memory-bound: warm start within the gap", False)
    return _search(p, start, relative_gap, lb, backend, deadline, seen, timings, on_progress,
                   "memory-bound: warm start, then search")


def _within(r: IlpResult | None, lb: float, gap: float) -> bool:
    return r is not None and r.objective_s - lb <= gap * r.objective_s


def _support(x: dict[str, list[float]]) -> dict[str, list[int]]:
    return {k: [i for i, v in enumerate(vals) if v > _SUPPORT] for k, vals in x.items()}


def _least_static(p: IlpProblem) -> dict[str, list[int]]:
    """Per parameter key, its strategies of least persistent memory (the most sharded storage)."""
    if p.memory is None:
        return {}
    return {k: [i for i, b in enumerate(v) if b <= min(v)] for k, v in p.memory.static.items()}


def _union(a: dict[str, list[int]], b: dict[str, list[int]]) -> dict[str, list[int]]:
    return {k: sorted(set(v) | set(b.get(k, ()))) for k, v in a.items()}


def _search(p: IlpProblem, start: IlpResult | None, gap: float, lb: float, backend: str, deadline: float | None,
            seen: _Tracker, timings: dict, on_progress, path: str) -> Bounded:
    t = time.perf_counter()
    try:
        r = solve(p, backend=backend, deadline=deadline, hint=None if start is None else start.choice,
                  relative_gap=gap, on_progress=on_progress)
    except SolverTimeout as e:
        if start is None:
            raise _timeout(e, seen) from None
        r = dataclasses.replace(start, stats=dict(start.stats, status="FEASIBLE"))
    timings["search_seconds"] = time.perf_counter() - t
    if r.bound_s < lb:
        r = dataclasses.replace(r, bound_s=lb)
    r.stats.update(timings, relaxation_bound_s=lb)
    return Bounded(r, path, r.stats["status"] != "OPTIMAL")


def _warm_start(p: IlpProblem, keep: dict[str, list[int]], backend: str, deadline: float | None,
                seen: _Tracker) -> IlpResult | None:
    """The best plan using only the strategies `keep` lists (None when they admit none)."""
    try:
        r = solve(restrict(p, keep), backend=backend, deadline=deadline)
    except (ProgramInfeasible, SolverTimeout):
        return None
    choice = {k: keep[k][i] for k, i in r.choice.items()}
    seen.see(choice)
    return dataclasses.replace(r, choice=choice)


def restrict(p: IlpProblem, keep: dict[str, list[int]]) -> IlpProblem:
    """The program over the strategies `keep` lists per key (indices into p's strategies)."""
    edges = [IlpEdge(e.src, e.dst, [e.src_index[i] for i in keep[e.src]],
                     None if e.dst is None else [e.dst_index[i] for i in keep[e.dst]], e.cost, e.group)
             for e in p.edges]
    return dataclasses.replace(p, n_strategies={k: len(v) for k, v in keep.items()},
                               compute={k: [p.compute[k][i] for i in v] for k, v in keep.items()}, edges=edges,
                               memory=None if p.memory is None else p.memory.restricted(keep))


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else deadline - time.monotonic()


def _timeout(e: SolverTimeout, seen: _Tracker) -> SolverTimeout:
    out = SolverTimeout(str(e))
    out.smallest_peak = seen.smallest
    return out
