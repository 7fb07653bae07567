"""Activation recomputation in the passes (a helper of annotate_shapes, solve_placements, simulate_step,
split_stages and build_plan, not a pass): which layer stacks recompute (autopar/recompute.py), as data the
integer program chooses with the placements.

    annotate_shapes:   recompute_baseline -- the variants fixed before the solve (Config.recompute "off", "selective",
                       "full"; the model's own checkpointed stacks), and the stacks the solver decides ("auto")
    solve_placements:  joint, chosen -- each stack the solver decides becomes a selector key of the placement
                       program (one strategy per variant), linked to every key whose recompute time or liveness
                       its variant changes: the link prices the recomputed ops' forward time on the local shapes
                       of each (strategy, variant) pair, and the memory rows count those keys' allocations with
                       each variant's liveness, conditional on the selector. One program chooses placements and
                       variants together.
                       combinations, apply -- the fallback where a key's liveness depends on two stacks'
                       variants at once (or under a pipeline): one program per combination of variants, solved
                       in turn, keeping activations first (and stopping there when memory does not bind)
    split_stages:      fractions -- the share of each key's instances recomputed, priced into a layer's backward
    build_plan:        summary -- per stack: variant, who chose it, time added, memory saved
"""
from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import torch.fx as fx

from autopar.passes.context import PassContext
from autopar.recompute import VARIANTS, model_checkpointed_layers, partial_variants, recomputed_nodes, split

SELECTOR = "recompute/"  # the selector key of a stack: SELECTOR + its prefix, one strategy per offered variant


@dataclasses.dataclass
class Joint:
    """The variants of the stacks the solver decides, as data for one placement program."""

    stacks: list[str]
    variants: dict[str, tuple[str, ...]]  # stack -> the variants its selector offers, "keep" first
    base: dict[str, str]  # every decided stack keeping its activations (the others as fixed)
    # (stack, variant) -> the memory profile's weights and the recompute shares per key with that stack at that
    # variant and every other decided stack keeping.
    weight: dict[tuple[str, str], np.ndarray]
    share: dict[tuple[str, str], dict[str, float]]
    owner: dict[str, str]  # key -> the one stack whose variant changes its liveness or its recompute share


def joint(ctx: PassContext) -> Joint | None:
    """The decided stacks as one program's selectors (built once per context), or None where the solve must
    branch: no stack to decide, a pipeline (whose stage memory follows the variants), or a key whose liveness or
    recompute share depends on more than one stack's variant (checked over every combination)."""
    if ctx.recompute_joint is not None or not ctx.recompute_offered or ctx.pipeline is not None:
        return ctx.recompute_joint or None
    from autopar.passes.memory_profile import _build, memory_profile

    cap, stacks = ctx.captured, list(ctx.recompute_offered)
    count = {b.prefix: (b.count, b.captured) for b in cap.blocks}
    offered = {s: VARIANTS + tuple(partial_variants(*count[s])) for s in stacks}
    base = dict(ctx.recompute_fixed)
    apply(ctx, base)
    prof, share0 = memory_profile(ctx), fractions(ctx, ctx.recomputed)
    weight, share, owner = {}, {}, {}

    def changed(w, sh) -> set[str]:
        cols = np.nonzero((w != prof.weight).any(axis=0))[0]
        return {prof.keys[c] for c in cols} | {k for k in set(sh) | set(share0) if sh.get(k) != share0.get(k)}

    for s in stacks:
        weight[(s, "keep")], share[(s, "keep")] = prof.weight, share0
        for v in offered[s][1:]:
            rec = recomputed_nodes(cap, {**base, s: v})
            p, sh = _build(ctx, rec), fractions(ctx, rec)
            if p.keys != prof.keys:
                return _branch(ctx)
            weight[(s, v)], share[(s, v)] = p.weight, sh
            for k in changed(p.weight, sh):
                if owner.setdefault(k, s) != s:
                    return _branch(ctx)
    out = Joint(stacks, offered, base, weight, share, owner)
    if len(stacks) > 1:  # each key follows its owner's variant alone, in every combination
        col = {k: c for c, k in enumerate(prof.keys)}
        for combo in itertools.product(*(offered[s] for s in stacks)):
            variants = dict(zip(stacks, combo))
            rec = recomputed_nodes(cap, {**base, **variants})
            p, sh = _build(ctx, rec), fractions(ctx, rec)
            w = prof.weight.copy()
            for k, s in owner.items():
                if k in col:
                    w[:, col[k]] = weight[(s, variants[s])][:, col[k]]
            want = {k: share[(owner[k], variants[owner[k]])].get(k) if k in owner else share0.get(k)
                    for k in set(sh) | set(share0) | set(owner)}
            if not np.array_equal(p.weight, w) or any(sh.get(k) != v for k, v in want.items()):
                return _branch(ctx)
    ctx.recompute_joint = out
    return out


def _branch(ctx: PassContext) -> None:
    ctx.recompute_joint = False
    return None


def chosen(ctx: PassContext, choice: dict[str, int]) -> dict[str, str] | None:
    """The variants a joint program's choice makes (its selector keys removed from `choice`), or None when the
    choice holds no selector."""
    offered = ctx.recompute_joint.variants if ctx.recompute_joint else {}
    picks = {k[len(SELECTOR):]: offered[k[len(SELECTOR):]][choice.pop(k)]
             for k in [k for k in choice if k.startswith(SELECTOR)]}
    return dict(ctx.recompute_fixed, **picks) if picks else None


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
    activations first: the order the solve tries them in. Partial variants ("full/r") are offered only in the
    joint program, where they cost one selector strategy each rather than a placement program each."""
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
    """Per layer stack: its variant (and "layers": r for "full/r", the first r layers recomputed, with "others":
    "selective" for "full/r/selective"), who chose it ("solver", "config" or "model"), the seconds per step its
    recomputation adds under the chosen placements, and the activation bytes per rank it saves at the peak
    (against keeping every activation, same placements). Where the model checkpoints some of a stack's layers
    itself (every n-th: transformers' activation_checkpointing_enable(every_n_layers=n)), "model_layers" says
    how many, and the time and bytes count their recomputation too."""
    from autopar.passes.memory_profile import _build

    out = {}
    share = fractions(ctx, ctx.recomputed)
    blocks = {b.prefix: b for b in ctx.captured.blocks}
    by_model = model_checkpointed_layers(ctx.captured)
    for prefix, variant in sorted(ctx.recompute.items()):
        mine = {n for n in ctx.recomputed if ctx.captured.block_of.get(n, ("",))[0] == prefix}
        partial = by_model.get(prefix, []) if ctx.recompute_by[prefix] != "model" else []
        if variant == "keep" and not (partial and mine):
            out[prefix] = {"variant": "keep", "by": ctx.recompute_by[prefix], "time_s": 0.0, "saved_bytes": 0}
            continue
        t = sum(recompute_time(ctx, k, ctx.choice[k], share)
                for k in {ctx.key[n] for n in mine if ctx.key[n] in ctx.choice})
        without = recomputed_nodes(ctx.captured, {p: v for p, v in ctx.recompute.items() if p != prefix},
                                   model=ctx.recompute_by[prefix] != "model" and not partial)
        saved = _build(ctx, without).peak(ctx.choice)[1] - memory_peak(ctx)
        kind, layers, others = split(variant)
        out[prefix] = {"variant": kind, "by": ctx.recompute_by[prefix],
                       "time_s": float(f"{ctx.microbatches * t:.6g}"), "saved_bytes": int(max(0.0, saved))}
        if partial:
            b = blocks[prefix]
            out[prefix]["model_layers"] = round(len(partial) * b.count / b.captured)
        if layers is not None:
            out[prefix]["layers"] = layers
            if others != "keep":
                out[prefix]["others"] = others
    return out


def memory_peak(ctx: PassContext) -> float:
    from autopar.passes.memory_profile import memory_profile

    return memory_profile(ctx).peak(ctx.choice)[1]


__all__ = ["joint", "chosen", "Joint", "SELECTOR", "combinations", "apply", "summary", "recompute_time",
           "fractions"]
