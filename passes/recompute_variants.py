"""Activation recomputation in the passes (a helper of annotate_shapes, solve_placements, simulate_step,
split_stages and build_plan, not a pass): which layer stacks recompute (autopar/recompute.py), as data the
integer program chooses with the placements.

    annotate_shapes:   recompute_baseline -- the variants fixed before the solve (Config.recompute "off", "selective",
                       "full"; the model's own checkpointed stacks), and the stacks the solver decides ("auto")
    solve_placements:  combinations, apply -- the program's recompute booleans (one per stack and variant) are
                       branched on first: each combination of variants makes the placement program whose
                       compute holds the recomputed ops' forward time on their local shapes (per strategy) and
                       whose memory rows hold that combination's liveness; solve_placements solves each (keeping
                       activations first, and stops there when memory does not bind) and keeps the fastest
    split_stages:      fractions -- the share of each key's instances recomputed, priced into a layer's backward
    build_plan:        summary -- per stack: variant, who chose it, time added, memory saved
"""
from __future__ import annotations

import itertools

import torch.fx as fx

from autopar.passes.context import PassContext
from autopar.recompute import VARIANTS, recomputed_nodes


def fractions(ctx: PassContext, recomputed: set[fx.Node]) -> dict[str, float]:
    """Per key, the share of its instances that backward recomputes (parameter-only values, which are
    recomputed in any case, left out)."""
    out: dict[str, float] = {}
    from autopar.passes.annotate_shapes import _scale

    for n in recomputed:
        if n in ctx.param_derived:
            continue
        key = ctx.key[n]
        if key in ctx.compute_cost and ctx.node_count[key]:
            out[key] = out.get(key, 0.0) + _scale(ctx, n)[1] / ctx.node_count[key]
    return out


def recompute_time(ctx: PassContext, key: str, index: int, share: dict[str, float]) -> float:
    """Seconds per microbatch backward spends recomputing `key` under its strategy `index`."""
    return share.get(key, 0.0) * ctx.compute_cost[key][index]


def combinations(ctx: PassContext) -> list[dict[str, str]]:
    """Every combination of variants over the stacks the solver decides (the others as fixed), keeping
    activations first: the order the solve tries them in."""
    out = []
    for combo in itertools.product(VARIANTS, repeat=len(ctx.recompute_offered)):
        out.append(dict(ctx.recompute_fixed, **dict(zip(ctx.recompute_offered, combo))))
    return out


def apply(ctx: PassContext, variants: dict[str, str]) -> None:
    """Make `variants` the context's: recomputed nodes, saved keys and their memory, the memory profile."""
    if variants == ctx.recompute and ctx.saved:
        return
    from autopar.passes.annotate_shapes import saved_keys
    from autopar.passes.estimate_costs import activation_memory

    ctx.recompute = dict(variants)
    ctx.recomputed = recomputed_nodes(ctx.captured, ctx.recompute)
    ctx.saved = saved_keys(ctx)
    for key in [k for k in ctx.memory_cost if not k.startswith("param/")]:
        del ctx.memory_cost[key]
    fresh = activation_memory(ctx)
    if ctx.pipeline is not None:
        for key, costs in fresh.items():
            ctx.pipeline.memory[key] = list(costs)
        for key in [k for k in ctx.pipeline.memory if not k.startswith("param/") and k not in fresh]:
            del ctx.pipeline.memory[key]
        fresh = {k: [c * ctx.pipeline.factor.get(k, 1.0) for c in v] for k, v in fresh.items()}
    ctx.memory_cost.update(fresh)
    ctx.memory_profile = None


def summary(ctx: PassContext) -> dict[str, dict]:
    """Per layer stack: its variant, who chose it ("solver", "config" or "model"), the seconds per step its
    recomputation adds under the chosen placements, and the activation bytes per rank it saves at the peak
    (against keeping every activation, same placements)."""
    from autopar.passes.memory_profile import _build

    out = {}
    share = fractions(ctx, ctx.recomputed)
    for prefix, variant in sorted(ctx.recompute.items()):
        if variant == "keep":
            out[prefix] = {"variant": "keep", "by": ctx.recompute_by[prefix], "time_s": 0.0, "saved_bytes": 0}
            continue
        mine = {n for n in ctx.recomputed if ctx.captured.block_of.get(n, ("",))[0] == prefix}
        t = sum(recompute_time(ctx, k, ctx.choice[k], share)
                for k in {ctx.key[n] for n in mine if ctx.key[n] in ctx.choice})
        others = recomputed_nodes(ctx.captured, {p: v for p, v in ctx.recompute.items() if p != prefix},
                                  model=ctx.recompute_by[prefix] != "model")
        saved = _build(ctx, others).peak(ctx.choice)[1] - memory_peak(ctx)
        out[prefix] = {"variant": variant, "by": ctx.recompute_by[prefix],
                       "time_s": float(f"{ctx.microbatches * t:.6g}"), "saved_bytes": int(max(0.0, saved))}
    return out


def memory_peak(ctx: PassContext) -> float:
    from autopar.passes.memory_profile import memory_profile

    return memory_profile(ctx).peak(ctx.choice)[1]


__all__ = ["combinations", "apply", "summary", "recompute_time", "fractions"]
