"""Planning speed: capture, ILP build, solve, total time and peak RSS for Llama-3 models on an 8x8 H100 mesh.

Usage: python benchmarks/plan_speed.py [--layers 2,8,32] [--models 8b,70b]
Each configuration runs in a fresh subprocess so peak RSS is per configuration.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import subprocess
import sys
import time


def run_one(model: str, layers: int | None, batch: int, seq: int) -> dict:
    import torch

    import autopar
    from autopar.models.llama import CONFIGS, Llama, cross_entropy_loss

    cfg = CONFIGS[f"llama3-{model}"]
    if layers:
        cfg = dataclasses.replace(cfg, n_layers=layers)
    t0 = time.perf_counter()
    with torch.device("meta"):
        m = Llama(cfg)
    mesh = autopar.fake_mesh((8, 8), ("dp", "tp"))
    config = autopar.Config(device="h100", links={"dp": "ib", "tp": "nvlink"}, memory_limit_gb=80,
                            solver=autopar.SolverConfig(show_progress=False))
    plan = autopar.plan(m, mesh, (torch.zeros(batch, seq, dtype=torch.long),), loss_fn=cross_entropy_loss,
                        config=config)
    total = time.perf_counter() - t0
    s = plan.solver_stats
    return {"model": f"llama3-{model}", "layers": cfg.n_layers, "capture_s": plan.timings["capture_s"],
            "passes_s": {k: round(v, 2) for k, v in plan.timings.items() if k != "capture_s"},
            "ilp_build_s": plan.timings["solver_build_seconds"], "solve_s": plan.timings["solver_solve_seconds"], "total_s": total,
            "variables": s["variables"], "optimal": s["optimal"],
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "step_time_s": plan.estimated_step_time, "peak_mem_gib": plan.peak_memory_per_rank / 2**30,
            "techniques": sorted(plan.techniques)}


DEFAULT_BATCH = {"8b": 16, "70b": 8}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--models", default="8b,70b")
    ap.add_argument("--layers", default="2,8,32", help="layer counts to run for 8b besides its full depth")
    ap.add_argument("--batch", type=int, default=None,
                    help="global batch (default: 16 for 8b; 8 for 70b, whose activations at batch 16 exceed "
                         "80 GiB per rank on 64 H100s without activation recomputation)")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        model, layers = a.one.split(":")
        print(json.dumps(run_one(model, int(layers) or None, a.batch or DEFAULT_BATCH[model], a.seq)))
        return
    runs = []
    for model in a.models.split(","):
        depths = [int(x) for x in a.layers.split(",")] if model == "8b" else [0]
        for d in depths:
            runs.append((model, d))
    print(f"{'model':12} {'layers':>6} {'capture':>8} {'build':>7} {'solve':>7} {'total':>7} {'vars':>8} "
          f"{'RSS GB':>7} {'step s':>8} {'mem GiB':>8}  techniques")
    for model, d in runs:
        batch = a.batch or DEFAULT_BATCH[model]
        out = subprocess.run([sys.executable, __file__, "--one", f"{model}:{d}", "--batch", str(batch),
                              "--seq", str(a.seq)], capture_output=True, text=True)
        if out.returncode:
            print(f"{model} {d}: failed\n{out.stderr[-2000:]}")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{r['model']:12} {r['layers']:>6} {r['capture_s']:8.2f} {r['ilp_build_s']:7.2f} {r['solve_s']:7.2f} "
              f"{r['total_s']:7.2f} {r['variables']:>8} {r['peak_rss_gb']:7.2f} {r['step_time_s']:8.4f} "
              f"{r['peak_mem_gib']:8.1f}  {','.join(r['techniques'])}  batch={batch}  passes={r['passes_s']}")


if __name__ == "__main__":
    main()
