"""Contractions: one-axis strategies of an einsum equation, and the matmul family expressed through it."""
from __future__ import annotations

import torch

from autopar.layout import R, S
from autopar.rules.base import AxisStrategy, OpInfo
from autopar.rules.common import PARTIALS, bcast
from autopar.rules.registry import register

aten = torch.ops.aten


def einsum_strategies(spec: str, *, linearity: bool = False) -> list[AxisStrategy]:
    """Strategies of `spec` ("mk,kn->mn") on one mesh axis, without all-replicate.

    Sharding an index kept in the output shards it on every operand that has it (R on the others) and on the
    output; sharding a contracted index shards it on the operands and makes the output Partial(sum). With
    `linearity`, a Partial on any one operand (R on the others) also gives a Partial output, as an einsum is
    linear in each operand. Size-1 dims are filtered by the registry, so this needs no shapes.
    """
    lhs, out = spec.replace(" ", "").split("->")
    operands = lhs.split(",")
    for t in operands + [out]:
        if len(set(t)) != len(t):
            raise ValueError(f"einsum spec {spec!r}: repeated index within one operand is not supported")
    contracted = [c for t in operands for c in t if c not in out]
    res = []
    for c in list(out) + list(dict.fromkeys(contracted)):
        ins = tuple(S(t.index(c)) if c in t else R for t in operands)
        res.append(AxisStrategy(ins, (S(out.index(c)) if c in out else PARTIALS[0],)))
    if linearity:
        for i in range(len(operands)):
            for p in PARTIALS:
                res.append(AxisStrategy(tuple(p if j == i else R for j in range(len(operands))), (p,)))
    return res


def with_addend(info: OpInfo, strategies: list[AxisStrategy]) -> list[AxisStrategy]:
    """`beta * addend + product`: the addend (input 0, broadcasting) follows the output's Shard and carries the
    same Partial when the product is Partial (the addend's parts then sum to the addend)."""
    out = info.outputs[0]
    res = []
    for s in strategies:
        o = s.outs[0]
        a = bcast(info.inputs[0], o.dim, out.ndim) if o.is_shard() else o
        res.append(AxisStrategy((a,) + s.ins, s.outs))
    return res


@register(aten.mm.default)
def mm(info: OpInfo):
    return einsum_strategies("mk,kn->mn")


@register(aten.bmm.default)
def bmm(info: OpInfo):
    return einsum_strategies("bmk,bkn->bmn")


@register(aten.mv.default)
def mv(info: OpInfo):
    return einsum_strategies("mk,k->m")


@register(aten.dot.default)
def dot(info: OpInfo):
    return einsum_strategies("k,k->")


@register(aten.addmm.default)
def addmm(info: OpInfo):
    return with_addend(info, einsum_strategies("mk,kn->mn"))


@register(aten.baddbmm.default)
def baddbmm(info: OpInfo):
    return with_addend(info, einsum_strategies("bmk,bkn->bmn"))


@register(aten.addmv.default)
def addmv(info: OpInfo):
    return with_addend(info, einsum_strategies("mk,k->m"))
