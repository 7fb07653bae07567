"""The one rule table: registration, lookup, and an op's normalized one-axis strategy list."""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch.distributed.tensor import Partial, Placement, Shard

from autopar.layout import R, fmt_layout
from autopar.rules.base import AxisStrategy, OpInfo, Rule

_RULES: dict[object, Rule] = {}
_MISSING: set[str] = set()


def register(*targets) -> Callable[[Rule], Rule]:
    """Register a rule for aten OpOverloads; an OpOverloadPacket stands for all of its overloads.

    A rule registered for an overload takes precedence over one registered for its packet.
    """
    for t in targets:
        if not isinstance(t, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            raise TypeError(f"register() takes aten OpOverloads or OpOverloadPackets, got {t!r}")

    def deco(rule: Rule) -> Rule:
        for t in targets:
            _RULES[t] = rule
        return rule

    return deco


def get_rule(target) -> Rule | None:
    rule = _RULES.get(target)
    if rule is None and isinstance(target, torch._ops.OpOverload):
        rule = _RULES.get(target.overloadpacket)
    return rule


def registered_targets() -> list[object]:
    """Every registered OpOverload and OpOverloadPacket, in registration order."""
    return list(_RULES)


def missing_ops() -> frozenset[str]:
    """Names of the aten ops `axis_strategies` was asked about that have no rule (for one warning each)."""
    return frozenset(_MISSING)


def clear_missing() -> None:
    _MISSING.clear()


def fmt_strategy(s: AxisStrategy) -> str:
    """`"S(0),R -> S(0)"`: input placements, then output placements."""
    return f"{fmt_layout(s.ins)} -> {fmt_layout(s.outs)}"


def all_replicate(info: OpInfo) -> AxisStrategy:
    return AxisStrategy((R,) * len(info.inputs), (R,) * len(info.outputs))


def axis_strategies(info: OpInfo) -> tuple[list[AxisStrategy], bool]:
    """All-replicate first, then the rule's strategies (deduplicated, in rule order); and whether a rule exists.

    Without a rule, DTensor's own strategy for the op stands in where torch has one; the op is recorded in
    `missing_ops()` either way. Strategies that shard a dimension of size < 2, or put a Partial on a bool tensor
    (or Partial(avg) on an integer one), are dropped here, so rules may emit them freely (e.g.
    `einsum_strategies`, which does not see shapes, or linear ops that also see integer tensors).
    """
    rule = get_rule(info.target)
    if rule is None:
        if isinstance(info.target, torch._ops.OpOverload):
            _MISSING.add(str(info.target))
        from autopar.rules._dtensor_fallback import dtensor_strategies

        raw: Sequence[AxisStrategy] = dtensor_strategies(info) or []
    else:
        raw = rule(info)
    out = [all_replicate(info)]
    seen = {out[0]}
    for s in raw:
        s = _normalize(info, s)
        if s is not None and s not in seen:
            seen.add(s)
            out.append(s)
    return out, rule is not None


def _normalize(info: OpInfo, s: AxisStrategy) -> AxisStrategy | None:
    """Check a rule's strategy against the op's tensors; None outputs get R; None if it shards a tiny dim."""
    if len(s.ins) != len(info.inputs) or len(s.outs) != len(info.outputs):
        raise RuntimeError(f"rule for {info.name} returned {fmt_strategy(s)} for {len(info.inputs)} tensor inputs "
                           f"and {len(info.outputs)} outputs")
    outs = tuple(R if meta is None else p for p, meta in zip(s.outs, info.outputs))
    for p, meta in zip(s.ins + outs, info.inputs + info.outputs):
        if not _placement_ok(p, meta, info, s):
            return None
    return AxisStrategy(s.ins, outs)


def _placement_ok(p: Placement, meta, info: OpInfo, s: AxisStrategy) -> bool:
    if isinstance(p, Partial):
        # Parts of a bool do not sum to it; an integer average is not exact.
        return meta.dtype.is_floating_point or (p.reduce_op == "sum" and meta.dtype != torch.bool)
    if not isinstance(p, Shard):
        return True
    if p.dim < 0 or p.dim >= meta.ndim:
        raise RuntimeError(f"rule for {info.name} returned {fmt_strategy(s)}: dim {p.dim} out of range for a "
                           f"tensor of shape {meta.shape} (dims must be normalized to 0..ndim-1)")
    return meta.shape[p.dim] >= 2


__all__ = ["register", "get_rule", "registered_targets", "missing_ops", "clear_missing", "fmt_strategy",
           "axis_strategies", "all_replicate"]
