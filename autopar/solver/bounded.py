"""Solve the placement program fast, under a memory bound or not, and say how far from optimal the answer may be.

1. Solve the relaxation of the strategy booleans, memory rows included. Its optimum is a lower bound on the
   program's; when it is infeasible no plan fits (a fast verdict); when its solution is integral and priced
   as the program prices it, it is the optimal plan (the usual case when the memory limit does not bind).
   Where the limit may bind, the least peak of a fractional choice comes first (a far smaller program without
   edges): above the limit, that relaxation is infeasible, and the verdict comes without it.
2. Otherwise solve the program restricted to the strategies the relaxation uses, plus, when the memory limit
   binds, each parameter's most sharded storage (a small program, quick; RENS in the MIP literature). If its
   plan is more than half the gap (2.5% without one) from the bound and memory binds, add the strategies of
   relaxations without memory rows that charge each strategy's bytes at the first relaxation's shadow prices
   times a markup (`_priced_relaxation`) and solve again: the relaxation fills the limit exactly by mixing
   strategies, a plan needs room to spare. Where none of these admits a plan that fits (a limit near the
   smallest feasible peak), add a plan of least peak and solve again. The best of these plans is the warm
   start.
3. Without `relative_gap` (the default), the warm start is the plan, reported with its gap to the relaxation's
   bound. With one, stop if the warm start is within it, else solve the whole program from the warm start until
   the plan is proven within it.

The result carries the best proven bound, so every plan reports how far from optimal it may be. Branch and
bound closes the last few percent only slowly (a binding memory row makes the relaxation mix strategies
fractionally), and that proof is what the default skips: the warm start is usually near-optimal, the bound is
what is weak.
Every step is deterministic: the same inputs give the same plan unless the deadline passes.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import os
import time
from typing import Callable

from autopar.errors import SolverTimeout
from autopar.solver.dispatch import solve
from autopar.solver.ilp import OPTIMALITY_TOLERANCE, IlpProblem, IlpResult, ProgramInfeasible
from autopar.solver.prune import restricted_links

_SUPPORT = 1e-6  # relaxation values above this count as used (and below 1 - this as fractional)
_MARKUPS = (0.0, 2.0)  # shadow-price markups of the priced relaxations (see _priced_relaxation)
_HALF_GAP = 0.025  # without a gap to prove, a warm start this far from the bound still tries the second one
_WAITS = 0.01  # expected waits above this share of the objective: offer plans without them
_PEAK_MARGIN = 1e-6  # a least fractional peak this far over the limit proves it infeasible
_QUIET_ITERATIONS, _QUIET_ITERATIONS_MIN = 3, 1000  # a quiet relaxation's simplex iterations: 3x its program's + 1000


@dataclasses.dataclass
class Bounded:
    result: IlpResult
    path: str  # how the plan was found
    timed_out: bool  # the deadline stopped the search: the plan is the best found, not proven within the gap
    # Plans that keep axes free of blocking backward collectives waiting behind gradient reductions, for the
    # step simulator to compare with `result` (the program cannot price those waits).
    alternatives: list[IlpResult] = dataclasses.field(default_factory=list)


class _Tracker:
    """The smallest peak of any choice met on the way, for the time-out message."""

    def __init__(self, p: IlpProblem):
        self.p, self.smallest = p, None
        if p.memory is not None:
            self.see(least_memory(p))

    def see(self, choice: dict[str, int]) -> None:
        if self.p.memory is not None:
            peak = self.p.memory.usage(choice)
            self.smallest = peak if self.smallest is None else min(self.smallest, peak)


def solve_bounded(p: IlpProblem, *, backend: str, deadline: float | None, relative_gap: float | None,
                  on_progress: Callable[[str], None] | None = None, start: dict[str, int] | None = None,
                  priced_right: Callable[[dict[str, int]], bool] | None = None,
                  waited: Callable[[dict[str, int]], dict[int, float]] | None = None) -> Bounded:
    """The plan by the path in the module's docstring; `start`, a plan of p known beforehand, is kept in the
    warm starts and starts them. `priced_right` says whether p prices a plan as it runs (a program that bounds
    some costs from below): where it says the first warm start's plan is not, that plan is returned as it
    stands (stats "mispriced"), with no second warm start, search or alternatives, for the caller to solve a
    program that prices it exactly; where it says so of the plan found after them, no alternatives. `waited`
    gives, per mesh axis, the seconds a plan's blocking collectives wait for the axis in a schedule of its step
    (the step simulator's): an axis where they wait less than _WAITS of the objective gets no alternative,
    whatever the estimate (IlpProblem.waits)."""
    if priced_right is not None:  # asked once per plan
        asked: dict[tuple, bool] = {}

        def priced_right(choice, ask=priced_right):
            key = tuple(sorted(choice.items()))
            if key not in asked:
                asked[key] = ask(choice)
            return asked[key]

    out = _solve(p, backend, deadline, relative_gap, on_progress, known=start, priced_right=priced_right)
    if priced_right is not None and "mispriced" not in out.result.stats:
        out.result.stats["mispriced"] = not priced_right(out.result.choice)
    # Blocking backward collectives may wait behind gradient reductions queued on their axis, which the program
    # cannot price: when the expected wait is costly, offer the best plans that keep the worst axis, then every
    # costly axis, free of them.
    waits = p.waits(out.result.choice)
    costly = sorted((ax for ax, w in waits.items() if w > _WAITS * out.result.objective_s), key=lambda ax: -waits[ax])
    if costly and waited is not None:  # where the schedule shows no such wait, the estimate is not acted on
        seen = waited(out.result.choice)
        costly = [ax for ax in costly if seen.get(ax, 0.0) > _WAITS * out.result.objective_s]
    # (Solved whole: restricted to the strategies of the main warm start, the quiet plans come out slower.) One
    # whose relaxation bound is above the plan's time with its expected waits cannot be faster: it is not solved.
    cutoff = out.result.objective_s + sum(waits.values())
    # A quiet program's relaxation is given a few times the simplex iterations the program's own took (where
    # simplex solved it): a plan the step simulator may prefer, not one that must be found (GPT-2 at hidden 64 on
    # 2x2 at 0.7x its peak: 68,816 iterations and 12.6 s against the program's 3,556).
    iterations = 0 if out.result.stats.get("barrier_iterations") else out.result.stats.get("iterations") or 0
    cap = _QUIET_ITERATIONS * iterations + _QUIET_ITERATIONS_MIN if iterations else None
    again = costly and not out.timed_out and not out.result.stats.get("mispriced")
    for quiet in dict.fromkeys([frozenset(costly[:1]), frozenset(costly)]) if again else ():
        try:
            r = _solve(dataclasses.replace(p, quiet_axes=quiet), backend, deadline, relative_gap, on_progress,
                       cutoff=cutoff, iteration_limit=cap)
        except (ProgramInfeasible, SolverTimeout):
            continue
        if r is None:
            continue
        r = r.result
        # Its own bound holds only where the axes are quiet: the whole program's bound is the one to report.
        bound = min(r.bound_s, out.result.bound_s)
        out.alternatives.append(dataclasses.replace(
            r, bound_s=bound, optimal=r.objective_s - bound <= OPTIMALITY_TOLERANCE * r.objective_s,
            stats=dict(r.stats, quiet_axes=sorted(quiet))))
    return out


def _solve(p: IlpProblem, backend: str, deadline: float | None, relative_gap: float | None,
           on_progress: Callable[[str], None] | None, cutoff: float | None = None,
           known: dict[str, int] | None = None,
           priced_right: Callable[[dict[str, int]], bool] | None = None,
           iteration_limit: int | None = None) -> Bounded | None:
    """The plan by the path above, from the plan `known` where one is given; None when the relaxation's bound
    is at least `cutoff` seconds; see solve_bounded for `priced_right`; SolverTimeout where the relaxation
    takes more than `iteration_limit` simplex iterations."""
    from autopar.solver.highs import peak_relaxation, relaxation_highs

    seen, timings = _Tracker(p), {}  # timings end in the plan's solver stats
    # A limit that no choice's peak reaches does not bind: the relaxation is the one without memory rows.
    limited = p.memory is not None and p.memory_limit is not None and p.memory.most() > p.memory_limit
    if limited and not p.quiet_axes:
        # The relaxation with memory rows is feasible exactly when the least peak of any fractional choice fits
        # (edges and links admit every choice): that program, without edges, is far smaller and proves a limit
        # infeasible in a fraction of the time.
        t = time.perf_counter()
        try:
            least = peak_relaxation(p, _remaining(deadline))
        except SolverTimeout as e:
            raise _timeout(e, seen) from None
        timings["peak_relaxation_seconds"] = time.perf_counter() - t
        if least > p.memory_limit * (1 + _PEAK_MARGIN):
            raise ProgramInfeasible("no choice of strategies satisfies the memory rows")
    with _Pool() as pool:
        # The relaxation without memory rows (markup 0 below) does not need the bounded one's prices: it runs
        # beside it, and is used only when memory binds.
        free = pool.submit(_priced_relaxation, p, [], 0.0, deadline) if limited else None
        t = time.perf_counter()
        try:
            lb, x, size = relaxation_highs(p, _remaining(deadline), iteration_limit)
        except SolverTimeout as e:
            raise _timeout(e, seen) from None
        prices = size.pop("memory_prices", [])
        timings["relaxation_seconds"] = time.perf_counter() - t
        if cutoff is not None and lb >= cutoff:
            return None
        binding = limited and p.memory.peak({k: {i: w for i, w in enumerate(v) if w > _SUPPORT}
                                             for k, v in x.items()}) >= p.memory_limit * (1 - 1e-9)
        if all(max(v) > 1 - _SUPPORT for v in x.values()):
            choice = {k: max(range(len(v)), key=v.__getitem__) for k, v in x.items()}
            obj = p.objective(choice)
            if obj - lb <= OPTIMALITY_TOLERANCE * obj:
                stats = dict(size, backend=backend, status="OPTIMAL", memory_binds=binding, **timings)
                return Bounded(IlpResult(choice, obj, lb, True, stats), "relaxation integral", False)
        if on_progress:
            on_progress("warm start from the relaxation")
        t = time.perf_counter()
        # Selectors (a layer stack's recompute variant) keep every strategy: a few columns each, and the
        # relaxation mixes them where a plan takes one.
        keep = _union(_support(x), {k: list(range(p.n_strategies[k])) for k in p.selectors()})
        keep = _union(keep, _least_static(p)) if binding else keep
        if known is not None:
            keep = _union(keep, {k: [i] for k, i in known.items()})
        # The relaxations with memory priced (_priced_relaxation) run beside the first warm start; they are
        # used only when that start is not within half the gap.
        priced = [free] + [pool.submit(_priced_relaxation, p, prices, m, deadline) for m in _MARKUPS if m] \
            if binding else []
        start = _warm_start(p, keep, backend, deadline, seen, known)
        if start is not None and priced_right is not None and not priced_right(start.choice):
            timings["warm_start_seconds"] = time.perf_counter() - t
            r = dataclasses.replace(start, bound_s=lb, optimal=False)
            r.stats.update(size, status="FEASIBLE", memory_binds=binding, mispriced=True, **timings)
            return Bounded(r, "warm start", False)
        if binding and not _within(start, lb, _HALF_GAP if relative_gap is None else relative_gap / 2):
            for f in priced:
                keep = _union(keep, f.result())
            # From the first plan: HiGHS starts with an incumbent.
            second = _warm_start(p, keep, backend, deadline, seen, None if start is None else start.choice)
            if second is not None and (start is None or second.objective_s < start.objective_s):
                start = second
    if start is None and binding:
        # Near the smallest feasible peak the supports may admit no plan that fits: add a plan of small peak
        # found without a solver, then one of least peak.
        keep = _union(keep, {k: [i] for k, i in least_memory(p).items()})
        start = _warm_start(p, keep, backend, deadline, seen)
    if start is None and binding:
        least, bound = _least_peak(p, backend, deadline)
        if bound > p.memory_limit:  # proven: no plan fits (the relaxation mixed strategies below every plan)
            raise ProgramInfeasible("no choice of strategies satisfies the memory rows")
        start = _warm_start(p, _union(keep, least), backend, deadline, seen)
    timings["warm_start_seconds"] = time.perf_counter() - t
    if start is not None and (relative_gap is None or _within(start, lb, relative_gap)):
        r = dataclasses.replace(start, bound_s=lb,
                                optimal=start.objective_s - lb <= OPTIMALITY_TOLERANCE * start.objective_s)
        r.stats.update(size, status="OPTIMAL", memory_binds=binding, **timings)
        return Bounded(r, "warm start", False)
    out = _search(p, start, relative_gap or 0.0, lb, backend, deadline, seen, timings, on_progress,
                  "warm start, then search")
    out.result.stats.update(memory_binds=binding)
    return out


def _priced_relaxation(p: IlpProblem, prices: list[float], markup: float, deadline: float | None
                       ) -> dict[str, list[int]]:
    """The strategies plans use when memory costs time: the support of the relaxation of the program without
    memory rows, each strategy charged its bytes at the bounded relaxation's shadow prices times a markup. At
    0 that is the unbounded plan (what to keep where memory is not tight); above 1 memory is priced above its
    marginal value, since the bounded relaxation fills the limit exactly by mixing strategies and a plan
    needs room to spare. Each is an unbounded relaxation, several times faster than one with memory rows.
    Empty when the deadline passes first."""
    from autopar.solver.highs import relaxation_highs

    mem, total = p.memory, sum(prices)
    compute = {k: list(v) for k, v in p.compute.items()}
    links = {(ln.key, ln.selector): [list(row) for row in ln.cost] for ln in p.links}
    if markup and total:
        weight = [0.0] * len(mem.terms)  # seconds per byte of each allocation term, summed over the points
        for price, row in zip(prices, mem.weights):
            for t, w in row.items():
                weight[t] += price * w
        for k, v in mem.static.items():
            compute[k] = [c + markup * total * b for c, b in zip(compute[k], v)]
        for t, ((k, b), w) in enumerate(zip(mem.terms, weight)):
            cond = mem.condition(t)
            if w and cond is None:
                compute[k] = [c + markup * w * x for c, x in zip(compute[k], b)]
            elif w:  # on the link's pairs with the condition's selector strategy
                cost = links[(k, cond[0])]
                for s, x in enumerate(b):
                    cost[s][cond[1]] += markup * w * x
    elif markup:
        return {}
    priced = [dataclasses.replace(ln, cost=links[(ln.key, ln.selector)]) for ln in p.links]
    edges = list(p.edges)
    if markup and total:  # every point holds the buffers: their pairs' bytes at the points' total price
        priced_pairs = [(e, total) for e in {id(e): e for buf in mem.buffers for e in buf}.values()]
        pair_weight = [0.0] * len(mem.pairs)  # a copy's pairs: at its points' prices
        for price, row in zip(prices, mem.aligned_pair_weights()):
            for j, w in row.items():
                pair_weight[j] += price * w
        priced_pairs += [(e, w) for e, w in zip(mem.pairs, pair_weight) if w]
        edges += [dataclasses.replace(e, cost=[[markup * w * b for b in row] for row in e.cost], group=None,
                                      axis_cost=None, contends=None, layered=False)
                  for e, w in priced_pairs]
    try:
        _, x, _ = relaxation_highs(dataclasses.replace(p, compute=compute, memory=None, memory_limit=None,
                                                       links=priced, edges=edges), _remaining(deadline))
    except (ProgramInfeasible, SolverTimeout):
        return {}
    return _support(x)


class _Later:
    """A call made when its result is first read (one core: nothing runs beside the caller)."""

    def __init__(self, fn, *args):
        self.fn, self.args, self.done = fn, args, False

    def result(self):
        if not self.done:
            self.value, self.done = self.fn(*self.args), True
        return self.value


class _Pool(concurrent.futures.ThreadPoolExecutor):
    """Runs independent solves beside the caller where the machine has a second core (HiGHS releases the GIL
    while it solves; each solve is single-threaded and deterministic, so the plan does not depend on timing).
    On one core a submitted call runs when its result is read, so work that turns out unneeded is not done.
    Leaving the pool does not wait for a solve whose result was not read: it ends on its own thread (HiGHS
    cannot be interrupted in an LP) while the caller goes on."""

    def __init__(self):
        self.beside = (os.cpu_count() or 1) > 1
        super().__init__(max_workers=1)

    def submit(self, fn, /, *args):
        return super().submit(fn, *args) if self.beside else _Later(fn, *args)

    def __exit__(self, *exc):
        self.shutdown(wait=False, cancel_futures=True)
        return False


def _least_peak(p: IlpProblem, backend: str, deadline: float | None) -> tuple[dict[str, list[int]], float]:
    """The strategies of a plan of least peak, and a proven lower bound on any plan's peak (none and 0 when the
    deadline passes first). Selectors are branched on: one program per combination of their strategies, each
    much faster to solve than the program that mixes them."""
    from autopar.solver.highs import peak_relaxation

    sels = sorted(p.selectors())
    best, bound = None, float("inf")
    # In order of their least fractional peak, each solved only while that bound is below the least peak found
    # (a combination skipped holds no plan under it: its bound stands for it).
    order = []
    for i, combo in enumerate(itertools.product(*(range(p.n_strategies[k]) for k in sels))):
        keep = {k: list(range(n)) for k, n in p.n_strategies.items()}
        keep.update({k: [r] for k, r in zip(sels, combo)})
        q = dataclasses.replace(restrict(p, keep), memory_limit=None)
        try:
            order.append((peak_relaxation(q, _remaining(deadline)), i, keep, q))
        except (ProgramInfeasible, SolverTimeout):
            return {}, 0.0
    for low, _, keep, q in sorted(order, key=lambda o: o[:2]):
        if best is not None and low >= best[0]:  # at or above a plan found: `bound` is already below it
            continue
        try:
            r = solve(q, backend=backend, deadline=deadline, objective="peak")
        except (ProgramInfeasible, SolverTimeout):
            return {}, 0.0
        bound = min(bound, r.bound_s)
        if best is None or r.objective_s < best[0]:
            best = (r.objective_s, {k: [keep[k][i]] for k, i in r.choice.items()})
    return best[1], bound


def least_memory(p: IlpProblem) -> dict[str, int]:
    """A plan of small peak found without a solver: per key, the strategy of least memory (the most sharded),
    its live bytes weighted by how often the candidate points hold them."""
    mem = p.memory
    weight = [0.0] * len(mem.terms)
    for row in mem.weights:
        for t, w in row.items():
            weight[t] += w
    # A selector first: the strategy whose conditional terms weigh least at their keys' smallest bytes.
    sel: dict[str, list[float]] = {k: [0.0] * p.n_strategies[k] for k in p.selectors()}
    for t, ((k, b), w) in enumerate(zip(mem.terms, weight)):
        c = mem.condition(t)
        if c is not None:
            sel[c[0]][c[1]] += w * min(b, default=0.0)
    out = {k: min(range(len(v)), key=v.__getitem__) for k, v in sel.items()}
    score = {k: [0.0] * n for k, n in p.n_strategies.items() if k not in out}
    for k, v in mem.static.items():
        score[k] = [a + len(mem.weights) * b for a, b in zip(score[k], v)]
    for t, ((k, b), w) in enumerate(zip(mem.terms, weight)):
        c = mem.condition(t)
        if c is None or out[c[0]] == c[1]:
            score[k] = [a + w * x for a, x in zip(score[k], b)]
    out.update({k: min(range(len(v)), key=v.__getitem__) for k, v in score.items()})
    return out


def _within(r: IlpResult | None, lb: float, gap: float) -> bool:
    return r is not None and r.objective_s - lb <= gap * r.objective_s


def _support(x: dict[str, list[float]]) -> dict[str, list[int]]:
    return {k: [i for i, v in enumerate(vals) if v > _SUPPORT] for k, vals in x.items()}


def _least_static(p: IlpProblem) -> dict[str, list[int]]:
    """Per parameter key, its strategies of least persistent memory (the most sharded storage)."""
    if p.memory is None:
        return {}
    return {k: [i for i, b in enumerate(v) if b <= min(v)] for k, v in p.memory.static.items()}


def _union(a: dict[str, list[int]], b: dict[str, list[int]]) -> dict[str, list[int]]:  # keys of a
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
                seen: _Tracker, start: dict[str, int] | None = None) -> IlpResult | None:
    """The best plan using only the strategies `keep` lists (None when they admit none), from the plan `start`
    where one is given (its strategies kept)."""
    hint = None
    if start is not None:
        pos = {k: {o: i for i, o in enumerate(v)} for k, v in keep.items()}
        hint = {k: pos[k][i] for k, i in start.items()}
    try:
        r = solve(restrict(p, keep), backend=backend, deadline=deadline, restricted=True, hint=hint)
    except (ProgramInfeasible, SolverTimeout):
        return None
    choice = {k: keep[k][i] for k, i in r.choice.items()}
    seen.see(choice)
    return dataclasses.replace(r, choice=choice)


def restrict(p: IlpProblem, keep: dict[str, list[int]]) -> IlpProblem:
    """The program over the strategies `keep` lists per key (indices into p's strategies)."""
    return dataclasses.replace(p, n_strategies={k: len(v) for k, v in keep.items()},
                               compute={k: [p.compute[k][i] for i in v] for k, v in keep.items()},
                               edges=[e.restricted(keep) for e in p.edges],
                               side_edges=[e.restricted(keep) for e in p.side_edges],
                               memory=None if p.memory is None else p.memory.restricted(keep),
                               links=restricted_links(p.links, keep))


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else deadline - time.monotonic()


def _timeout(e: SolverTimeout, seen: _Tracker) -> SolverTimeout:
    out = SolverTimeout(str(e))
    out.smallest_peak = seen.smallest
    return out
