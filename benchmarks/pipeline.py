"""Pipeline schedules and pipeline planning.

1. Simulates one step of a 32-layer model on 8 pipeline ranks with 64 microbatches under every schedule autopar
   runs (each layer: forward 1, backward-input 1, backward-weight 1 time units; no transfer time) and prints the
   bubble fraction (share of the ranks' time idle), the idle-to-busy ratio and the simulation's wall time.
2. Plans Llama-3-405B on 512 H100s (pp 8 x dp 8 x tp 8, 64 sequences of 8192 tokens, memory unbounded until
   activation recomputation lands) and prints the plan time, stages, schedule, estimated step time and peak
   memory, with every schedule's estimate.

Usage: python benchmarks/pipeline.py [--skip-plan] [--microbatches N]
"""
from __future__ import annotations

import argparse
import time


def simulate_schedules(layers: int = 32, pp: int = 8, microbatches: int = 64) -> None:
    import torch.distributed.pipelining  # noqa: F401 - imported before timing (the first import takes seconds)

    from autopar.cost.pipeline import StageTimes, simulate_schedule
    from autopar.passes.split_stages import CANDIDATES

    print(f"{layers} layers, {pp} pipeline ranks, {microbatches} microbatches (layer: F=1 I=1 W=1)")
    print(f"{'schedule':32s} {'v':>2s} {'bubble':>8s} {'idle/busy':>10s} {'(p-1)/(v m)':>12s} {'step':>8s} {'sim s':>7s}")
    for schedule, v in CANDIDATES:
        per_stage = layers / (pp * v)
        t = StageTimes(forward=per_stage, backward_input=per_stage, backward_weight=per_stage)
        t0 = time.perf_counter()
        tl = simulate_schedule(schedule, pp, microbatches, [t] * (pp * v), v)
        wall = time.perf_counter() - t0
        print(f"{schedule:32s} {v:2d} {tl.bubble_fraction:8.4f} {tl.idle_ratio:10.4f} "
              f"{(pp - 1) / (v * microbatches):12.4f} {tl.makespan:8.1f} {wall:7.3f}")


def plan_405b(microbatches: int | None) -> None:
    import torch

    import autopar
    from autopar.models.llama import LLAMA3_405B, Llama, cross_entropy_loss

    with torch.device("meta"):
        model = Llama(LLAMA3_405B)
    mesh = autopar.fake_mesh((8, 8, 8), ("pp", "dp", "tp"))
    config = autopar.Config(device="h100", memory_limit_gb=1e6, microbatches=microbatches,
                            solver=autopar.SolverConfig(show_progress=False))
    t0 = time.perf_counter()
    plan = autopar.plan(model, mesh, (torch.zeros(64, 8192, dtype=torch.long),), loss_fn=cross_entropy_loss,
                        config=config)
    took = time.perf_counter() - t0
    pp = plan.pipeline
    print(f"\nLlama-3-405B on pp 8 x dp 8 x tp 8 H100, 64 x 8192 tokens: planned in {took:.1f} s")
    print(plan.summary().rstrip())
    print(f"  estimated step {plan.estimated_step_time:.3f} s, peak memory {plan.peak_memory_per_rank / 2**30:.1f} GiB "
          f"per rank, stage time max/min {max(pp.stage_time_s) / min(pp.stage_time_s):.3f}")
    print(f"  {'schedule':32s} {'v':>2s} {'step s':>8s} {'bubble':>8s} {'peak GiB':>9s}")
    for s in pp.schedules:
        print(f"  {s['schedule']:32s} {s['virtual_stages']:2d} {s['step_time_s']:8.3f} {s['bubble_fraction']:8.4f} "
              f"{s['peak_memory'] / 2**30:9.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skip-plan", action="store_true", help="only simulate the schedules")
    ap.add_argument("--microbatches", type=int, default=None,
                    help="fix the microbatch count of the 405B plan (default: the planner's choice)")
    a = ap.parse_args()
    simulate_schedules()
    if not a.skip_plan:
        plan_405b(a.microbatches)


if __name__ == "__main__":
    main()
