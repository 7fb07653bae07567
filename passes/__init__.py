"""The compiler pipeline: passes `(gm, ctx) -> gm`, run in order by `run_passes`."""
from __future__ import annotations

import time
from typing import Callable

import torch.fx as fx

from autopar.passes.context import PassContext
from autopar.passes.annotate_shapes import annotate_shapes_pass
from autopar.passes.enumerate_strategies import enumerate_strategies_pass
from autopar.passes.estimate_costs import estimate_costs_pass
from autopar.passes.merge_followers import merge_followers_pass
from autopar.passes.solve_placements import solve_placements_pass
from autopar.passes.simulate_step import simulate_step_pass
from autopar.passes.build_plan import build_plan_pass
from autopar.passes.split_stages import split_stages_pass, stage_memory_pass

Pass = Callable[[fx.GraphModule, PassContext], fx.GraphModule]

# Order and why:
#  annotate_shapes first: every later pass reads node keys, phases and saved-for-backward sets from it;
#  enumerate_strategies before estimate_costs: costs are priced per enumerated strategy;
#  merge_followers after estimate_costs: it reads the edges, and the ILP folds followers' priced costs in;
#  stage_memory after estimate_costs and before solve_placements: it scales the priced memory to one pipeline
#    rank's share (a stage's layers, the microbatches in flight), which the ILP's memory row then bounds;
#  solve_placements needs the priced strategies and edges;
#  simulate_step needs the chosen strategies (it re-prices the step with overlap and liveness);
#  split_stages after simulate_step: it prices a layer under the chosen strategies, cuts the stages, picks the
#    schedule and replaces the step's time and memory with the pipeline's;
#  build_plan last: it packages choices and simulated figures into the Plan.
PASSES: tuple[Pass, ...] = (
    annotate_shapes_pass,
    enumerate_strategies_pass,
    estimate_costs_pass,
    merge_followers_pass,
    stage_memory_pass,
    solve_placements_pass,
    simulate_step_pass,
    split_stages_pass,
    build_plan_pass,
)


class PassError(RuntimeError):
    pass


def run_passes(gm: fx.GraphModule, ctx: PassContext, passes: tuple[Pass, ...] = PASSES) -> fx.GraphModule:
    done: list[str] = []
    for p in passes:
        t0 = time.perf_counter()
        try:
            gm = p(gm, ctx)
        except ValueError:
            raise
        except Exception as e:
            raise PassError(f"pass {p.__name__} failed after {done or 'no passes'}: {type(e).__name__}: {e}") from e
        ctx.timings[p.__name__] = time.perf_counter() - t0
        done.append(p.__name__)
    return gm
