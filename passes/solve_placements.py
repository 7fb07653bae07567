"""Run the integer program over the priced strategies; refine the memory bound with the step simulator."""
from __future__ import annotations

import warnings

import torch.fx as fx

from autopar.errors import InfeasibleMemoryError
from autopar.passes.context import PassContext
from autopar.solver import IlpProblem, solve
from autopar.solver.ilp import IlpEdge
from autopar.solver.prune import reduce_problem


def _root(ctx: PassContext, key: str) -> tuple[str, list[int] | None]:
    return ctx.follow.get(key, (key, None))


def build_problem(ctx: PassContext, memory_limit: float | None) -> IlpProblem:
    """The ILP over root keys: followers' compute, memory and edges are folded into their root."""
    n = {k: len(v) for k, v in ctx.strategies.items() if k not in ctx.follow}
    # With microbatches, ops and their collectives run once per microbatch; a parameter's optimizer step and
    # its gradient's reduction once per step.
    m = ctx.microbatches
    compute = {k: [c if k.startswith("param/") else m * c for c in ctx.compute_cost[k]] for k in n}
    memory: dict[str, list[float]] = {k: list(ctx.memory_cost.get(k, [0.0] * n[k])) for k in n}
    for key, (root, idx) in ctx.follow.items():
        for i, j in enumerate(idx):
            compute[root][i] += m * ctx.compute_cost[key][j]
            if key in ctx.memory_cost:
                memory[root][i] += ctx.memory_cost[key][j]
    edges = []
    # Gradient reductions overlap the rest of the backward: codegen issues each bucket as soon as its gradients
    # exist, so what is left when the backward ends is about the last layer's bucket. A model of L repeated
    # layers prices them at 1/(L+1) of their time (in full without repeated layers). Parameter gathers stay
    # priced in full: they are prefetched one layer ahead only, and they share each axis's link with the
    # blocking activation collectives.
    # Several microbatches reduce gradients once, after the last backward: nothing left to hide them behind.
    layers = sum(b.count for b in ctx.captured.blocks)
    exposed = 1.0 / (layers + 1) if m == 1 else 1.0
    for e, c in zip(ctx.edges, ctx.edge_cost):
        scale = exposed if e.kind == "grad" else m
        cost = [[scale * v for v in row] for row in c.cost] if scale != 1 else c.cost
        src, smap = _root(ctx, e.src)
        src_index = c.src_index if smap is None else [c.src_index[j] for j in smap]
        if e.kind == "loss":
            edges.append(IlpEdge(src, None, src_index, None, cost))
            continue
        dst, dmap = _root(ctx, e.dst)
        dst_index = c.dst_index if dmap is None else [c.dst_index[j] for j in dmap]
        edges.append(IlpEdge(src, dst, src_index, dst_index, cost))
    sc = ctx.config.solver
    limit = ctx.config.solver_time_limit_s if ctx.config.solver_time_limit_s is not None else sc.time_limit_s
    return IlpProblem(n_strategies=n, compute=compute, memory=memory, edges=edges, memory_limit=memory_limit,
                      time_limit_s=limit, seed=sc.seed, workers=sc.workers)


def expand_choice(ctx: PassContext, choice: dict[str, int]) -> dict[str, int]:
    out = dict(choice)
    for key, (root, idx) in ctx.follow.items():
        out[key] = idx[choice[root]]
    return out


def solve_placements_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    from autopar.passes.simulate_step import simulate

    limit = float(ctx.memory_limit)
    report = ctx.progress.update if ctx.progress is not None else None
    for attempt in range(ctx.config.solver.memory_refinements + 1):
        problem = build_problem(ctx, limit)
        reduced = reduce_problem(problem)
        result = solve(reduced.problem, on_progress=report, backend=ctx.config.solver.backend)
        if result is None:
            _raise_infeasible(ctx)
        ctx.choice = expand_choice(ctx, reduced.expand(result.choice))
        ctx.solver_stats = dict(result.stats, keys_before_pruning=len(problem.n_strategies),
                                strategies_before_pruning=sum(problem.n_strategies.values()), optimal=result.optimal, objective_s=result.objective_s,
                                refinements=attempt)
        sim = simulate(ctx)
        if sim.peak_memory <= ctx.memory_limit:
            break
        # The linear estimate missed transient buffers: tighten by the overshoot and solve again.
        limit -= (sim.peak_memory - ctx.memory_limit) * 1.05
    if not result.optimal:
        warnings.warn(f"the solver hit its time limit ({problem.time_limit_s} s) before proving "
                      "optimality; returning the best plan found (raise Config(solver_time_limit_s=...))",
                      stacklevel=2)
    return gm


def _raise_infeasible(ctx: PassContext) -> None:
    best = solve(build_problem(ctx, None), minimize_memory=True)
    if best is None:
        raise InfeasibleMemoryError("no plan exists (the strategy space is empty)")
    consumers = []
    choice = expand_choice(ctx, best.choice)
    for key, costs in ctx.memory_cost.items():
        consumers.append((costs[choice[key]], key))
    consumers.sort(reverse=True)
    total = sum(c for c, _ in consumers)
    top = ", ".join(f"{k} {c / 2**30:.2f} GiB" for c, k in consumers[:5])
    raise InfeasibleMemoryError(
        f"no plan fits the memory limit of {ctx.memory_limit / 2**30:.2f} GiB per rank; the smallest plan found "
        f"needs {total / 2**30:.2f} GiB (largest consumers: {top}). Use more ranks, a smaller batch or sequence, "
        "or raise memory_limit_gb.")
