"""Planning under memory pressure: plan time, peak memory, techniques and estimated step time at memory limits of
1.0x, 0.7x, 0.5x and 0.3x the unconstrained plan's peak (below the smallest feasible peak: the infeasible
verdict's time, then a plan at the smallest feasible peak, plus 0.5% for the rounding of the verdict's figure).

Models: the small transformers models of autopar/testing/hf_models.py (hidden 64, 2 layers) on a fake 2x2 CPU
mesh, the example Llama (LLAMA_SMALL) on the same mesh, and Llama-3-8B (batch 16) and 70B (batch 8, also at
80 GB per rank) on a fake 8x8 H100 mesh (dp over InfiniBand, tp over NVLink), sequence 8192; `8b-node`:
Llama-3-8B (batch 8) on one node of 8 H100s as a 2x4 mesh (also at 80 GB per rank).

Usage: python benchmarks/plan_pressure.py [--models opt,qwen2,...,llama-small,8b,70b,8b-node] [--fractions 1,0.7,0.5,0.3]
                                         [--recompute auto|off|selective|full] [--repeat N]
With recompute "auto" (the default) a binding limit makes the planner solve one placement program per recompute
variant of the layer stack (keep, selective, full); "off" times the placement program alone.
Each plan runs in a fresh process (wall and CPU seconds of the whole autopar.plan call, capture included). The
ratio column is the plan time over the 1.0x plan time of the same model. With --repeat N every row is planned N
times in turn and reports its least wall and CPU time (this machine's noise only ever adds time); the plans of a
row's runs must agree (planning is deterministic), else the row says so.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time

HF = ["bert", "gpt2", "gpt_neox", "llama", "opt", "qwen2", "t5", "vit"]


def _build(name: str):
    import torch

    import autopar
    from autopar.models.llama import LLAMA3_8B, LLAMA3_70B, LLAMA_SMALL, Llama, cross_entropy_loss
    from autopar.testing import hf_models

    cpu = dict(mesh=autopar.fake_mesh((2, 2), ("dp", "tp"), device_type="cpu"), config={})
    if name == "8b-node":  # one node of 8 GPUs as a 2x4 mesh, every link NVLink
        with torch.device("meta"):
            model = Llama(LLAMA3_8B)
        return dict(model=model, args=(torch.zeros(8, 8192, dtype=torch.long),), kwargs=None,
                    loss_fn=cross_entropy_loss, mesh=autopar.fake_mesh((2, 4), ("dp", "tp")),
                    config=dict(device="h100", links={"dp": "nvlink", "tp": "nvlink"}))
    if name in ("8b", "70b"):
        with torch.device("meta"):
            model = Llama(LLAMA3_8B if name == "8b" else LLAMA3_70B)
        batch = 16 if name == "8b" else 8
        return dict(model=model, args=(torch.zeros(batch, 8192, dtype=torch.long),), kwargs=None,
                    loss_fn=cross_entropy_loss, mesh=autopar.fake_mesh((8, 8), ("dp", "tp")),
                    config=dict(device="h100", links={"dp": "ib", "tp": "nvlink"}))
    if name == "llama-small":
        torch.manual_seed(0)
        return dict(model=Llama(LLAMA_SMALL), args=(torch.zeros(8, 32, dtype=torch.long),), kwargs=None,
                    loss_fn=cross_entropy_loss, **cpu)
    torch.manual_seed(0)
    model, args, kwargs = hf_models.MODELS[name](batch=4, **({} if name in hf_models.IMAGE_MODELS else {"seq": 16}))
    return dict(model=model, args=args, kwargs=kwargs, loss_fn=None, **cpu)


def run_one(name: str, limit_bytes: float | None, recompute: str = "auto") -> dict:
    import warnings

    import autopar

    b = _build(name)
    # Unconstrained: a limit no plan reaches (the device's own memory would bind the 70B).
    limit_gb = 1e6 if limit_bytes is None else limit_bytes / 2**30
    cfg = autopar.Config(solver=autopar.SolverConfig(show_progress=False), memory_limit_gb=limit_gb,
                         recompute=recompute, **b["config"])
    t0, c0 = time.perf_counter(), time.process_time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            p = autopar.plan(b["model"], b["mesh"], b["args"], example_kwargs=b["kwargs"], loss_fn=b["loss_fn"],
                             config=cfg)
        except autopar.InfeasibleMemoryError as e:
            m = re.search(r"needs ([\d.]+) (B|KiB|MiB|GiB)", str(e))
            scale = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[m.group(2)]
            return {"infeasible": True, "smallest": float(m.group(1)) * scale,
                    "wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0}
    s = p.solver_stats
    return {"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0, "peak": p.peak_memory_per_rank,
            "step_s": p.estimated_step_time, "techniques": ",".join(sorted(p.techniques)) or "-",
            "gap": s.get("gap", 0.0), "optimal": bool(s.get("optimal")), "path": s.get("path", "")}


def _best(name: str, limit: float | None, recompute: str, repeat: int) -> dict:
    """The row's plan, with the least wall and CPU time of `repeat` runs."""
    runs = [_sub(name, limit, recompute) for _ in range(repeat)]
    if any("error" in r for r in runs):
        return next(r for r in runs if "error" in r)
    plan = {k: v for k, v in runs[0].items() if k not in ("wall_s", "cpu_s")}
    if any({k: v for k, v in r.items() if k not in ("wall_s", "cpu_s")} != plan for r in runs[1:]):
        return {"error": f"the {repeat} runs gave different plans"}
    return dict(plan, wall_s=min(r["wall_s"] for r in runs), cpu_s=min(r["cpu_s"] for r in runs))


def _sub(name: str, limit: float | None, recompute: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--one", json.dumps([name, limit, recompute])], capture_output=True,
                         text=True)
    if out.returncode:
        return {"error": (out.stderr.strip().splitlines() or ["?"])[-1][:120]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _row(name: str, label: str, r: dict, base_wall: float | None) -> str:
    if "error" in r:
        return f"| {name} | {label} | error: {r['error']} |||||"
    ratio = f"{r['wall_s'] / base_wall:.1f}x" if base_wall else "-"
    if r.get("infeasible"):
        return (f"| {name} | {label} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | {ratio} | infeasible: smallest "
                f"{_fmt_bytes(r['smallest'])} | - | - | - |")
    gap = "optimal" if r["optimal"] else f"{r['gap']:.1%}"
    return (f"| {name} | {label} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | {ratio} | {_fmt_bytes(r['peak'])} | "
            f"{r['techniques']} | {r['step_s'] * 1e3:.3f} ms | {gap} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--models", default=",".join(HF + ["llama-small", "8b", "70b"]))
    ap.add_argument("--fractions", default="1,0.7,0.5,0.3")
    ap.add_argument("--recompute", default="auto", help="Config.recompute of every plan (auto, off, selective, full)")
    ap.add_argument("--repeat", type=int, default=1, help="plan each row N times; report its least time")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(run_one(*json.loads(a.one))))
        return
    print("| model | limit | plan s (wall) | plan s (CPU) | vs 1.0x | peak / verdict | techniques | step | gap |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in a.models.split(","):
        base = _best(name, None, a.recompute, a.repeat)
        print(_row(name, "1.0x", base, None), flush=True)
        if "peak" not in base:
            continue
        for f in [float(x) for x in a.fractions.split(",") if float(x) != 1.0]:
            r = _best(name, f * base["peak"], a.recompute, a.repeat)
            print(_row(name, f"{f}x", r, base["wall_s"]), flush=True)
            if r.get("infeasible"):
                print(_row(name, "smallest", _best(name, r["smallest"] * 1.005, a.recompute, a.repeat), base["wall_s"]),
                      flush=True)
                break
        if name in ("70b", "8b-node"):
            print(_row(name, "80 GB", _best(name, 80 * 2**30, a.recompute, a.repeat), base["wall_s"]), flush=True)


if __name__ == "__main__":
    main()
