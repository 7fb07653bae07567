"""What the torch.compile backend costs: the first compile of the example Llama split into Dynamo, capture,
planning, codegen and the inner compiler; the recompile of the same graph with the plan cache warm; and the
step time of the compiled module against `autopar.parallelize()` under the same plan, on 4 gloo CPU processes.

Usage (from the repo root): python benchmarks/compile_overhead.py [--model llama-small] [--batch 8] [--seq 32]
                                   [--steps 10] [--inner eager,inductor] [--graph-break]

Every figure is rank 0's. First compile: the first call's forward and backward (Dynamo traces the module and
calls the backend; the backend captures, plans (rank 0, sent to the others), generates this rank's Program and
shards the parameters; with Inductor, the rank's forward and backward graphs compile on their first calls).
Dynamo's share is the first forward's wall time less the backend's and less a warm forward. Recompile: a fresh
copy of the model compiled with the same backend object (Dynamo's caches reset), whose graph, shapes, mesh and
config match: the cached plan is checked and reused, so only capture and codegen are paid. Step: forward +
backward + AdamW, the median of `--steps` steps after 3 warm-up steps, each between barriers, the compiled
module's and parallelize()'s steps alternating. `--graph-break`: instead, the step time of the model compiled
with a graph break before its final norm against the same model compiled whole.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402


class Step(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, tokens):
        from autopar.models import cross_entropy_loss

        return cross_entropy_loss(self.model(tokens), tokens)


def _build(name: str, batch: int, seq: int):
    from autopar.models import CONFIGS, Llama

    torch.manual_seed(0)
    cfg = CONFIGS[name]
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
    return Step(Llama(cfg)), tokens


def _steps(engines: list, n: int) -> list[float]:
    """Median step time of each (step function, parameters), their steps alternating A B A B ... so a busy
    machine slows both alike."""
    import torch.distributed as dist

    opts = [torch.optim.AdamW(params, lr=1e-4, foreach=True) for _, params in engines]
    times: list[list[float]] = [[] for _ in engines]
    for i in range(3 + n):
        for (fn, _), opt, ts in zip(engines, opts, times):
            dist.barrier()
            t0 = time.perf_counter()
            fn().backward()
            opt.step()
            opt.zero_grad()
            dist.barrier()
            if i >= 3:
                ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) for ts in times]


def measure(name: str, batch: int, seq: int, steps: int, inner: str) -> dict:
    import torch._dynamo
    from torch.distributed.device_mesh import init_device_mesh

    import autopar

    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    config = autopar.Config(solver=autopar.SolverConfig(show_progress=False))
    b = autopar.backend(mesh, config=config.with_(inner_compiler=inner))
    step, tokens = _build(name, batch, seq)
    cm = torch.compile(step, backend=b, dynamic=False)
    t0 = time.perf_counter()
    loss = cm(tokens)
    t1 = time.perf_counter()
    inner_fwd = b.inner_s[0]  # Inductor compiling the forward graph, during the first forward
    loss.backward()
    t2 = time.perf_counter()
    t3 = time.perf_counter()
    cm(tokens)  # a warm forward
    warm_fwd = time.perf_counter() - t3
    first = b.timings[0]
    backend_s = first["capture_s"] + first["plan_s"] + first["codegen_s"]
    inner_s = b.inner_s[0]
    out = {"inner": inner, "first_call_s": t2 - t0,
           "dynamo_s": (t1 - t0) - backend_s - warm_fwd - inner_fwd,
           "capture_s": first["capture_s"], "plan_s": first["plan_s"], "codegen_s": first["codegen_s"],
           "inner_compile_s": inner_s}
    # parallelize() of the same Step module with every parameter pinned where the backend's plan put it.
    placed = {k: tuple(v) for k, v in next(iter(b._plans.values())).param_placements().items()}
    model, _ = _build(name, batch, seq)
    pm = autopar.parallelize(model, mesh, (tokens,), config=config.with_(pins=placed), compile=inner == "inductor")
    compiled_s, parallelize_s = _steps([(lambda: cm(tokens), list(step.parameters())),
                                        (lambda: pm(tokens), list(pm.parameters()))], steps)
    out.update(compiled_step_s=compiled_s, parallelize_step_s=parallelize_s,
               same_parameter_placements=pm.plan.param_placements() == placed)
    # Recompile with the plan cache warm: a fresh model, the same backend object.
    torch._dynamo.reset()
    fresh, _ = _build(name, batch, seq)
    b.inner_s[0] = 0.0
    t0 = time.perf_counter()
    loss = torch.compile(fresh, backend=b, dynamic=False)(tokens)
    loss.backward()
    again = b.timings[-1]
    out.update(recompile_s=time.perf_counter() - t0, recompile_capture_s=again["capture_s"],
               recompile_plan_s=again["plan_s"], recompile_codegen_s=again["codegen_s"],
               recompile_inner_s=b.inner_s[0], reused=bool(again["reused"]))
    return out


def measure_break(name: str, batch: int, seq: int, steps: int) -> dict:
    """What a graph break costs: the same model compiled twice with the eager inner compiler, once as one
    graph and once with a graph break before its final norm (Dynamo then hands over several graphs, each
    planned on its own, the values crossing the break replicated); their step times alternating."""
    import torch._dynamo
    from torch.distributed.device_mesh import init_device_mesh

    import autopar

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    config = autopar.Config(solver=autopar.SolverConfig(show_progress=False), inner_compiler="eager")
    engines, out = [], {}
    torch._dynamo.reset()  # once: a reset would drop the first module's compiled code and its backend's hook
    for broken in (False, True):
        b = autopar.backend(mesh, config=config)
        step, tokens = _build(name, batch, seq)
        if broken:
            norm = step.model.norm
            forward = norm.forward
            norm.forward = lambda x, forward=forward: (torch._dynamo.graph_break(), forward(x))[1]
        cm = torch.compile(step, backend=b, dynamic=False)
        t0 = time.perf_counter()
        cm(tokens).backward()
        key = "break" if broken else "whole"
        out[f"{key}_first_call_s"] = time.perf_counter() - t0
        out[f"{key}_graphs_planned"] = b.stats["planned"]
        engines.append((lambda cm=cm, tokens=tokens: cm(tokens), list(step.parameters())))
    whole_s, break_s = _steps(engines, steps)
    out.update(whole_step_s=whole_s, break_step_s=break_s)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-small")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--inner", default="eager,inductor")
    ap.add_argument("--graph-break", action="store_true",
                    help="instead: the step time of the model compiled with a graph break against without one")
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from autopar.testing.dist import get_pool

    pool = get_pool(4)
    if args.graph_break:
        res = pool.run(measure_break, args.model, args.batch, args.seq, args.steps, timeout=1800)[0]
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in res.items()}))
        return
    for inner in args.inner.split(","):
        res = pool.run(measure, args.model, args.batch, args.seq, args.steps, inner, timeout=1800)[0]
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in res.items()}))


if __name__ == "__main__":
    main()
