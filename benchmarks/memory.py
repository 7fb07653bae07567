"""Activation recomputation and the memory model.

1. Llama-3 8B and 70B (and 405B with --405b) on H100 meshes at 80 GB per rank: peak memory per rank and
   estimated step time with recomputation chosen by the solver (Config(recompute="auto")), none ("off") and
   full recomputation of every layer ("full"); and 70B at 70 GB, between the selective and the full plans'
   peaks, where a partial variant ("full/r", "full/r/selective") can win. A plan that does not fit shows the
   smallest peak found.
2. On CPU (4 gloo processes, a (dp=2, tp=2) mesh, a Llama of 4 layers of width 256 on 8 x 64 tokens): the
   peak memory per rank the plan predicts against the one measured over a step after a warm-up step
   (autopar.testing.memory), for the solver's plan with and without recomputation (selective, full, and the
   first 2 of the 4 layers in full, the others selective) and the DP, FSDP, FSDP+TP and Megatron recipes.
   With --tokens 4x8 (sequences x tokens), a step whose weights outweigh its activations.
3. With --pressure: the same comparison for the solver's plans of small transformers models (hidden 64, 2 layers,
   4 x 16 tokens or 4 images; autopar.testing.hf_models) on that mesh under memory limits of a fraction of their
   unconstrained peak (--models, --fractions), the limit each plan was made for beside it.

Usage: python benchmarks/memory.py [--405b] [--no-cpu] [--tokens 8x64]
       python benchmarks/memory.py --pressure [--models bert,opt,qwen2,vit] [--fractions 1,0.7,0.5,0.3]
"""
from __future__ import annotations

import argparse
import time

import torch

import autopar
from autopar import Config, SolverConfig
from autopar.errors import InfeasibleMemoryError
from autopar.models import LLAMA_SMALL, Llama, cross_entropy_loss
from autopar.models.llama import LLAMA3_8B, LLAMA3_70B, LLAMA3_405B
from autopar.recompute import plan_variants

QUIET = SolverConfig(show_progress=False)
GIB = 2**30
CASES = {  # name: (config, mesh shape, axis names, sequences, tokens per sequence, extra Config fields)
    "llama3-8b": (LLAMA3_8B, (2, 4), ("dp", "tp"), 8, 8192, {"links": {"dp": "nvlink", "tp": "nvlink"}}),
    "llama3-70b": (LLAMA3_70B, (8, 8), ("dp", "tp"), 16, 8192, {"links": {"dp": "ib", "tp": "nvlink"}}),
    "llama3-405b": (LLAMA3_405B, (8, 8, 8), ("pp", "dp", "tp"), 64, 8192, {}),
}


def plan_row(name: str, mode: str, limit_gb: float = 80) -> str:
    cfg, shape, names, batch, seq, extra = CASES[name]
    with torch.device("meta"):
        model = Llama(cfg)
    t0 = time.perf_counter()
    try:
        p = autopar.plan(model, autopar.fake_mesh(shape, names, "h100"), (torch.zeros(batch, seq, dtype=torch.long),),
                         loss_fn=cross_entropy_loss,
                         config=Config(device="h100", memory_limit_gb=limit_gb, recompute=mode, solver=QUIET, **extra))
    except InfeasibleMemoryError as e:
        low = getattr(e, "smallest_peak", None)
        seen = f"smallest peak {low / GIB:6.1f} GiB" if low is not None else str(e).split(":")[1][:60]
        return f"{name:12} {limit_gb:4g} {mode:5} {'does not fit':>21}  {seen}  ({time.perf_counter() - t0:5.1f} s)"
    rc = ", ".join(f"{k} {v}" for k, v in plan_variants(p).items())
    return (f"{name:12} {limit_gb:4g} {mode:5} {p.peak_memory_per_rank / GIB:8.1f} GiB {p.estimated_step_time:8.3f} s  "
            f"{rc:23} {','.join(sorted(p.techniques)):22} ({time.perf_counter() - t0:5.1f} s)")


def build_small(batch: int = 8, seq: int = 64):
    torch.manual_seed(0)
    tokens = torch.randint(0, LLAMA_SMALL.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
    return Llama(LLAMA_SMALL), (tokens,), cross_entropy_loss


def cpu_table(batch: int = 8, seq: int = 64) -> None:
    import functools

    from autopar import recipes
    from autopar.mesh import MeshSpec
    from autopar.testing.dist import get_pool
    from autopar.testing.memory import measure_plan_step

    names, shape = ("dp", "tp"), (2, 2)
    pool = get_pool(4)
    build = functools.partial(build_small, batch, seq)
    model, inputs, loss_fn = build()
    spec = MeshSpec(names, shape, ("loopback", "loopback"), "cpu")
    shapes = {k: tuple(p.shape) for k, p in model.named_parameters()}
    kinds = {"solver": {}, "solver, selective": {"recompute": "selective"}, "solver, full": {"recompute": "full"},
             "solver, full/2/sel": {"recompute": "full/2/selective"}}
    kinds.update({r: dict(recipes.recipe(r)(shapes, spec, n_inputs=1), recompute="off")
                  for r in ("ddp", "fsdp", "fsdp+tp", "megatron")})
    print(f"\n{'plan':18} {'predicted':>10} {'measured':>10} {'ratio':>6}")
    for kind, cfg in kinds.items():
        p = autopar.plan(model, autopar.fake_mesh(shape, names, "cpu"), inputs, loss_fn=loss_fn,
                         config=Config(solver=QUIET, **cfg))
        measured = max(r["peak"] for r in pool.run(measure_plan_step, build, p.to_json()))
        print(f"{kind:18} {p.peak_memory_per_rank / 2**20:7.2f} MiB {measured / 2**20:7.2f} MiB "
              f"{measured / p.peak_memory_per_rank:6.3f}")


def pressure_table(models: list[str], fractions: list[float]) -> None:
    import functools

    from autopar.testing.dist import get_pool
    from autopar.testing.memory import build_hf, measure_plan_step

    pool = get_pool(4)
    mesh = autopar.fake_mesh((2, 2), ("dp", "tp"), "cpu")
    print(f"\n{'model':8} {'limit':>5} {'limit KiB':>10} {'predicted':>10} {'measured':>10} {'ratio':>6}  techniques")
    for name in models:
        build = functools.partial(build_hf, name)
        model, args, _, kwargs = build()
        free = None
        for f in fractions:
            limit = None if f == 1 else f * free
            try:
                p = autopar.plan(model, mesh, args, example_kwargs=kwargs,
                                 config=Config(solver=QUIET, memory_limit_gb=None if limit is None else limit / GIB))
            except InfeasibleMemoryError as e:
                print(f"{name:8} {f:5g} {limit / 2**10:10.1f} does not fit: smallest {e.smallest_peak / 2**10:.1f} KiB",
                      flush=True)
                continue
            free = free or p.peak_memory_per_rank
            measured = max(r["peak"] for r in pool.run(measure_plan_step, build, p.to_json()))
            lim = "-" if limit is None else f"{limit / 2**10:.1f}"
            print(f"{name:8} {f:5g} {lim:>10} {p.peak_memory_per_rank / 2**10:10.1f} {measured / 2**10:10.1f} "
                  f"{measured / p.peak_memory_per_rank:6.3f}  {','.join(sorted(p.techniques)) or '-'}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--405b", dest="big", action="store_true", help="also plan Llama-3-405B (about a minute each)")
    ap.add_argument("--no-cpu", action="store_true", help="skip the measured CPU table")
    ap.add_argument("--tokens", default="8x64", help="the CPU table's sequences x tokens per sequence")
    ap.add_argument("--cpu-only", action="store_true", help="only the measured CPU table")
    ap.add_argument("--pressure", action="store_true", help="only the measured table of small transformers models "
                                                            "under memory limits")
    ap.add_argument("--models", default="bert,opt,qwen2,vit", help="the --pressure table's models")
    ap.add_argument("--fractions", default="1,0.7,0.5,0.3", help="the --pressure table's limits, as fractions of "
                                                                  "the unconstrained peak (1 first)")
    args = ap.parse_args()
    if args.pressure:
        pressure_table(args.models.split(","), [float(x) for x in args.fractions.split(",")])
        return
    batch, seq = (int(x) for x in args.tokens.split("x"))
    if args.cpu_only:
        cpu_table(batch, seq)
        return
    print(f"{'model':12} {'GB':>4} {'mode':5} {'peak/rank':>12} {'step':>10}  {'recompute':23} {'techniques':22} "
          "(planning)")
    for name in ("llama3-8b", "llama3-70b") + (("llama3-405b",) if args.big else ()):
        for mode in ("auto", "off", "full"):
            print(plan_row(name, mode), flush=True)
    # Between the selective and the full plan's peak: the first half of the layers in full, the rest selective.
    print(plan_row("llama3-70b", "auto", limit_gb=70), flush=True)
    if not args.no_cpu:
        cpu_table(batch, seq)


if __name__ == "__main__":
    main()
