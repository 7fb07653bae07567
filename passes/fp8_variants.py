"""FP8 variants of matmuls in the passes (a helper of enumerate_strategies, estimate_costs and build_plan, not
a pass): the variant is one more dimension of a node's strategy, so the integer program chooses it with the
layout and needs no new formulation.

    enumerate_strategies: add_variants  -- each eligible layout strategy of an FP8 site gets FP8 copies
    estimate_costs:       price_variants, edge_class, weight_edge_cost -- compute time of each variant; the
                          FP8 all-gather variant's weight edge in its own layout class
    build_plan:           record -- the chosen variant and every variant's cost per node; the plan's FP8 summary
"""
from __future__ import annotations

import dataclasses
import warnings

from autopar.cost.fp8 import has_fp8
from autopar.fp8.sites import find_sites
from autopar.fp8.variants import device_offers_fp8, eligible, variant_time, weight_edge_time
from autopar.rules.base import op_info
from autopar.strategy import FP8_TENSORWISE_AG, VARIANT_TEXT, NodeStrategy


def add_variants(ctx) -> None:
    """Find the FP8 sites (ctx.fp8_sites) and, where the config and device offer FP8, give each eligible layout
    strategy its FP8 copies; under mode "all" an eligible layout keeps its FP8 copies only."""
    cfg = ctx.config.fp8_config
    ctx.fp8_sites = find_sites(ctx, cfg.exclude)
    if cfg.mode == "all" and not has_fp8(ctx.hw) and ctx.hw.name != "cpu":
        raise ValueError(f"Config(fp8='all') on device {ctx.hw.name!r}: it has no FP8 tensor cores and "
                         "torch._scaled_mm does not run there; use fp8='off' (or 'auto', which never picks FP8 on "
                         "it), or plan for an FP8 device such as 'h100'")
    if not device_offers_fp8(ctx.hw, cfg):
        return
    if cfg.mode == "all" and not has_fp8(ctx.hw):
        warnings.warn(f"Config(fp8='all') on device {ctx.hw.name!r}, which has no FP8 tensor cores: the FP8 matmuls "
                      "run through torch._scaled_mm for their numerics and are priced at the rate of the plain "
                      "matmul plus their casts", stacklevel=3)
    sizes = ctx.mesh.shape
    for key, site in ctx.fp8_sites.items():
        if key not in ctx.strategies:
            continue
        shapes = [m.shape for m in op_info(ctx.members[key][0]).inputs]
        out: list[NodeStrategy] = []
        for s in ctx.strategies[key]:
            variants = eligible(site, s, shapes, sizes, cfg)
            if cfg.mode != "all" or not variants:
                out.append(s)
            out.extend(NodeStrategy(s.ins, s.outs, v) for v in variants)
        ctx.strategies[key] = out


def price_variants(ctx) -> None:
    """Compute time of every FP8 strategy (the plain strategies keep their roofline price)."""
    for key, site in ctx.fp8_sites.items():
        strats = ctx.strategies.get(key, [])
        if not any(s.variant for s in strats):
            continue
        info = op_info(ctx.members[key][0])
        shapes, dtypes = [m.shape for m in info.inputs], [m.dtype for m in info.inputs]
        for i, s in enumerate(strats):
            if s.variant:
                ctx.compute_cost[key][i] = ctx.node_count[key] * variant_time(site, s.variant, s, shapes, dtypes,
                                                                               ctx.mesh.shape, ctx.hw)


def edge_class(ctx, e, strategy: NodeStrategy) -> str:
    """The destination class an edge's cost depends on beyond the layout: "fp8ag" for the weight operand of an
    FP8 all-gather variant, else ""."""
    if strategy.variant != FP8_TENSORWISE_AG or e.kind not in ("param", "activation"):
        return ""
    site = ctx.fp8_sites.get(e.dst)
    return "fp8ag" if site is not None and site.weight == e.arg else ""


def weight_edge_cost(ctx, e, src: tuple, dst: tuple, plain: float) -> float:
    """Seconds of an FP8 all-gather weight edge (already multiplied by the edge count, as `plain` is)."""
    site = ctx.fp8_sites[e.dst]
    per = plain / e.count if e.count else 0.0
    return e.count * weight_edge_time(site, tuple(e.meta.shape), e.meta.dtype, src, dst, ctx.mesh, ctx.hw, per)


def normalize_choice(ctx) -> None:
    """An FP8 all-gather variant whose weight is not gathered (its edge has no all-gather) costs exactly what the
    plain tensorwise variant does (the weight is cast where it is used): record it as that variant."""
    from autopar.redistribute import plan_steps
    from autopar.strategy import FP8_TENSORWISE

    for e, c in zip(ctx.edges, ctx.edge_cost):
        if c.dst_index is None or e.dst not in ctx.choice:
            continue
        s = ctx.chosen(e.dst)
        if not edge_class(ctx, e, s):
            continue
        src = c.src_layouts[c.src_index[ctx.choice[e.src]]]
        steps = plan_steps(tuple(src), tuple(s.ins[e.arg]))
        if not steps or any(st.kind != "all_gather" for st in steps):
            plain = NodeStrategy(s.ins, s.outs, FP8_TENSORWISE)
            ctx.choice[e.dst] = ctx.strategies[e.dst].index(plain)


def variant_costs(ctx, key: str, chosen: NodeStrategy, plain_cost) -> dict[str, float]:
    """{variant text: seconds per step} of every variant the chosen layout may run as (the plain one first),
    priced whether or not the config offered FP8, so a plan shows what FP8 would change."""
    site = ctx.fp8_sites.get(key)
    if site is None:
        return {}
    info = op_info(ctx.members[key][0])
    shapes, dtypes = [m.shape for m in info.inputs], [m.dtype for m in info.inputs]
    cfg = ctx.config.fp8_config
    base = NodeStrategy(chosen.ins, chosen.outs)
    variants = eligible(site, base, shapes, ctx.mesh.shape, dataclasses.replace(cfg, fp8_all_gather=False))
    if not variants or not (has_fp8(ctx.hw) or cfg.mode == "all"):  # A100 under "auto": FP8 is not an option
        return {}
    out = {ctx.precision.name: float(f"{plain_cost(base):.6g}")}
    count = ctx.node_count[key]
    for v in variants:
        out[VARIANT_TEXT[v]] = float(f"{count * variant_time(site, v, base, shapes, dtypes, ctx.mesh.shape, ctx.hw):.6g}")
    return out


def summary(ctx, nodes: dict) -> dict:
    """The plan's FP8 figures: mode, matmuls in FP8 of the eligible ones, compute time saved (layouts held),
    and, with FP8 off on FP8 hardware, what "auto" would save on the same layouts."""
    cfg = ctx.config.fp8_config
    plain = ctx.precision.name
    sites = [k for k in ctx.fp8_sites if nodes.get(k) is not None and nodes[k].variant_costs]
    chosen = [k for k in sites if nodes[k].variant]
    saved = sum(nodes[k].variant_costs[plain] - nodes[k].compute_s for k in chosen)
    would = sum(max(0.0, nodes[k].variant_costs[plain] - min(v for t, v in nodes[k].variant_costs.items()
                                                             if t != plain)) for k in sites)
    count = lambda keys: sum(ctx.node_count[k] for k in keys)  # noqa: E731
    out = {"mode": cfg.mode, "fp8_gemms": count(chosen), "eligible_gemms": count(sites),
           "compute_saved_s": float(f"{saved:.6g}")}
    if not cfg.enabled and has_fp8(ctx.hw):
        out["auto_would_save_s"] = float(f"{would:.6g}")
    return out if sites else {}
