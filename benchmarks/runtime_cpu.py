"""Measured step time of autopar's generated programs against torch's own engines, 4 gloo CPU processes.

Usage (from the repo root): python benchmarks/runtime_cpu.py [--steps 20] [--warmup 3] [--batch 8] [--seq 32] [--pairs dp,fsdp,megatron,auto]
                                   [--compile]

One training step = forward + backward + AdamW step, the same global batch for every engine, fp32 everywhere.
AdamW runs the same implementation on both sides of a pair (--optimizer; default foreach, torch's default on GPU).
With torch's CPU default, the per-tensor loop, every optimizer op on a DTensor parameter pays DTensor dispatch:
that costs autopar (and FSDP2) against DDP's plain tensors, and says nothing about the generated program.
Pairs, each measured side by side in one worker function: both engines are built and warmed up, then steps
alternate A B A B ...; every step starts after a barrier and its time is the slowest rank's. The ratio of a pair
is the median over the per-step ratios autopar / torch.

  ddp       autopar with the DDP recipe pinned (mesh (4,) dp)   vs torch DistributedDataParallel
  fsdp      autopar with the FSDP recipe pinned (mesh (4,) dp)  vs FSDP2 fully_shard on every block and the root
  megatron  autopar with the Megatron recipe pinned (mesh (4,) tp) vs DTensor parallelize_module
            (Colwise wq/wk/wv/w1/w3, Rowwise wo/w2, per-block n_heads and n_kv_heads divided by 4)
  auto      autopar's own plan (no pins) on mesh (4,) dp and on (2, 2) dp x tp vs the fastest torch engine above
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

CFG_NAME = "llama-small"
WORLD = 4


# --- engines (built on every rank) -----------------------------------------------------------------------------
def _model():
    from autopar.models import CONFIGS, Llama

    torch.manual_seed(0)
    return Llama(CONFIGS[CFG_NAME])


def _tokens(batch: int, seq: int) -> torch.Tensor:
    from autopar.models import CONFIGS

    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, CONFIGS[CFG_NAME].vocab_size, (batch, seq), generator=gen)


def _mesh(shape, names):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


OPTIMIZER = {"foreach": {"foreach": True}, "loop": {"foreach": False}, "fused": {"fused": True}}


class _Optimizers:
    """Several optimizers stepped as one."""

    def __init__(self, opts):
        self.opts = opts

    def step(self):
        for o in self.opts:
            o.step()

    def zero_grad(self, set_to_none: bool = True):
        for o in self.opts:
            o.zero_grad(set_to_none=set_to_none)


def _adamw(params, optimizer: str):
    """AdamW over params. torch's foreach and fused kernels cannot mix DTensor and plain parameters (as
    parallelize_module leaves them: norms and embeddings stay plain), so those get one optimizer per kind;
    AdamW updates every parameter independently, so the step is the same."""
    from torch.distributed.tensor import DTensor

    params = list(params)
    groups = [[p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)]]
    groups = [g for g in groups if g] if optimizer != "loop" else [params]
    return _Optimizers([torch.optim.AdamW(g, lr=1e-3, **OPTIMIZER[optimizer]) for g in groups])


def build(kind: str, batch: int, seq: int, optimizer: str, compile: bool = False):
    """(step function returning the global mean loss, description) for one engine."""
    import torch.distributed as dist

    from autopar.models import cross_entropy_loss

    rank = dist.get_rank()
    tokens = _tokens(batch, seq)
    local = tokens.chunk(WORLD)[rank].contiguous()
    model = _model()

    if kind.startswith("autopar"):
        import autopar
        from autopar import recipes
        from autopar.mesh import mesh_spec

        _, recipe, shape = kind.split(":")
        shape = tuple(int(s) for s in shape.split("x"))
        names = {"megatron": ("tp",)}.get(recipe, ("dp",) if len(shape) == 1 else ("dp", "tp"))
        mesh = _mesh(shape, names)
        cfg = autopar.Config(solver=autopar.SolverConfig(show_progress=False))
        if recipe != "auto":
            shapes = {k: tuple(p.shape) for k, p in model.named_parameters()}
            cfg = cfg.with_(**recipes.RECIPES[recipe](shapes, mesh_spec(mesh)))
        pm = autopar.parallelize(model, mesh, (tokens,), loss_fn=cross_entropy_loss, config=cfg, compile=compile)
        opt = _adamw(pm.parameters(), optimizer)

        def step():
            opt.zero_grad(set_to_none=True)
            loss = pm(tokens)
            loss.backward()
            opt.step()
            return loss.detach()

        return step, f"{sorted(pm.plan.techniques)}"

    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model)
        opt = _adamw(ddp.parameters(), optimizer)

        def step():
            opt.zero_grad(set_to_none=True)
            loss = cross_entropy_loss(ddp(local), local)
            loss.backward()
            opt.step()
            loss = loss.detach().clone()
            dist.all_reduce(loss)  # for the printed loss only, after the timed work of the step
            return loss / WORLD

        return step, "DDP"

    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        mesh = _mesh((WORLD,), ("dp",))
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = _adamw(model.parameters(), optimizer)

        def step():
            opt.zero_grad(set_to_none=True)
            loss = cross_entropy_loss(model(local), local)
            loss.backward()
            opt.step()
            loss = loss.detach().clone()
            dist.all_reduce(loss)
            return loss / WORLD

        return step, "fully_shard per block + root"

    if kind == "tp":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = _mesh((WORLD,), ("tp",))
        plan = {f"attention.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")}
        plan.update({f"feed_forward.{w}": ColwiseParallel() for w in ("w1", "w3")})
        plan.update({"attention.wo": RowwiseParallel(), "feed_forward.w2": RowwiseParallel()})
        for block in model.layers:
            parallelize_module(block, mesh, plan)
            block.attention.n_heads //= WORLD  # the local heads, as torchtitan does
            block.attention.n_kv_heads //= WORLD
        opt = _adamw(model.parameters(), optimizer)

        def step():
            opt.zero_grad(set_to_none=True)
            loss = cross_entropy_loss(model(tokens), tokens)
            loss.backward()
            opt.step()
            return loss.detach()

        return step, "parallelize_module Colwise/Rowwise"

    raise KeyError(kind)


def bench_pair(a: str, b: str, batch: int, seq: int, warmup: int, steps: int, optimizer: str,
               compile: bool = False) -> dict:
    """Builds a and b, warms both up, then alternates one step of each; per-step times are the slowest rank's."""
    import torch.distributed as dist

    t0 = time.perf_counter()
    step_a, desc_a = build(a, batch, seq, optimizer, compile)
    build_a = time.perf_counter() - t0
    step_b, desc_b = build(b, batch, seq, optimizer)
    losses = {a: [], b: []}
    for _ in range(warmup):
        losses[a].append(step_a().item())
        losses[b].append(step_b().item())
    times = torch.zeros(2, steps, dtype=torch.float64)
    for i in range(steps):
        for j, fn in enumerate((step_a, step_b)):
            dist.barrier()
            t = time.perf_counter()
            fn()
            times[j, i] = time.perf_counter() - t
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return {"a": times[0].tolist(), "b": times[1].tolist(), "loss0_a": losses[a][0], "loss0_b": losses[b][0],
            "desc_a": desc_a, "desc_b": desc_b, "build_a_s": build_a}


# --- driver -----------------------------------------------------------------------------------------------------
def summarize(name: str, a: str, b: str, r: dict) -> dict:
    ratios = [x / y for x, y in zip(r["a"], r["b"])]
    return {"pair": name, "autopar": a, "torch": b, "a_ms": 1e3 * statistics.median(r["a"]),
            "b_ms": 1e3 * statistics.median(r["b"]), "ratio": statistics.median(ratios),
            "ratio_lo": min(ratios), "ratio_hi": max(ratios), **r}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8, help="global batch (split 4 ways for the data-parallel engines)")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--optimizer", choices=sorted(OPTIMIZER), default="foreach",
                    help="AdamW implementation, the same for both engines (default: foreach, torch's default on "
                         "GPU; 'loop' is torch's CPU default)")
    ap.add_argument("--pairs", default="dp,fsdp,megatron,auto",
                    help="comma-separated subset of dp, fsdp, megatron, auto (auto compares with the fastest torch "
                         "engine measured, DDP when none was)")
    ap.add_argument("--compile", action="store_true",
                    help="run autopar's programs through torch.compile (parallelize(compile=True); compiled during "
                         "warm-up); torch's engines stay eager")
    args = ap.parse_args()

    from autopar.testing.dist import close_pools, get_pool

    t_start = time.perf_counter()
    pool = get_pool(WORLD, threads=1)
    kw = dict(batch=args.batch, seq=args.seq, warmup=args.warmup, steps=args.steps, optimizer=args.optimizer,
              compile=args.compile)
    print(f"model {CFG_NAME}, global batch {args.batch}x{args.seq} tokens, {WORLD} gloo CPU ranks x 1 thread "
          f"({os.cpu_count()} cores), fp32, AdamW {args.optimizer}, {args.warmup} warm-up + {args.steps} interleaved "
          f"steps per pair{', autopar compiled (torch.compile), torch eager' if args.compile else ''}",
          flush=True)
    pairs = set(args.pairs.split(","))
    unknown = pairs - {"dp", "fsdp", "megatron", "auto"}
    if unknown:
        ap.error(f"unknown pairs {sorted(unknown)}; choose from dp, fsdp, megatron, auto")
    rows = []
    for key, name, a, b in (("dp", "DP", "autopar:ddp:4", "ddp"), ("fsdp", "FSDP", "autopar:fsdp:4", "fsdp2"),
                            ("megatron", "Megatron TP", "autopar:megatron:4", "tp")):
        if key not in pairs:
            continue
        r = pool.run(bench_pair, a, b, **kw)[0]
        rows.append(summarize(name, a, b, r))
        print(f"  done {name}: {rows[-1]['a_ms']:.1f} ms vs {rows[-1]['b_ms']:.1f} ms", flush=True)
    fastest = min(rows, key=lambda r: r["b_ms"])["torch"] if rows else "ddp"
    for name, a in (("auto (4,) dp", "autopar:auto:4"), ("auto (2,2) dp,tp", "autopar:auto:2x2")) * ("auto" in pairs):
        r = pool.run(bench_pair, a, fastest, **kw)[0]
        rows.append(summarize(name, a, fastest, r))
        print(f"  done {name}: {rows[-1]['a_ms']:.1f} ms vs {rows[-1]['b_ms']:.1f} ms", flush=True)
    close_pools()

    print()
    head = (f"{'pair':<17} {'autopar engine':<19} {'torch engine':<7} {'autopar ms':>10} {'torch ms':>9} "
            f"{'ratio':>6} {'ratio min-max':>14}  {'loss0 autopar/torch':>20}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['pair']:<17} {r['autopar']:<19} {r['torch']:<7} {r['a_ms']:>10.1f} {r['b_ms']:>9.1f} "
              f"{r['ratio']:>6.2f} {r['ratio_lo']:>6.2f}-{r['ratio_hi']:<7.2f}  "
              f"{r['loss0_a']:>9.5f}/{r['loss0_b']:<9.5f}")
    print()
    print("ms: median step time (forward + backward + AdamW), slowest rank; ratio: median over steps of "
          "autopar/torch (<1: autopar faster)")
    for r in rows:
        if r["autopar"].startswith("autopar:auto"):
            print(f"{r['pair']}: autopar chose {r['desc_a']}")
    print(f"total {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
