"""Sharding rules of autopar's FP8 cast ops (autopar/codegen/kernels), attached by that package when it defines
the ops (`register_rules`), since the ops exist only once their modules are imported.

A cast is exact on a shard when the shard holds every value its scale is taken over: rowwise scales run along
the rows of the output, so rows may be split (the rows of x^T are the columns of x); a tensorwise cast is exact
on shards only when the amax is given (already reduced over the whole tensor), else a shard's own amax would
scale it differently from the whole (all-replicate, added by the registry, is then its only strategy).
"""
from __future__ import annotations

from autopar.layout import R, S
from autopar.rules.base import OpInfo, strat


def _tensorwise(info: OpInfo):
    if len(info.inputs) < 2:  # no amax given
        return []
    return [strat([S(d), R], [S(d), R]) for d in range(info.inputs[0].ndim)]


def _rowwise(info: OpInfo):
    return [strat([S(0)], [S(0), S(0)])]


def _transpose(info: OpInfo):
    rowwise = info.args[2] if len(info.args) > 2 else info.kwargs.get("rowwise")
    if rowwise:
        return [strat([S(1)], [S(0), S(0)])]
    if len(info.inputs) < 2:
        return []
    return [strat([S(d), R], [S(1 - d), R]) for d in (0, 1)]


def register_rules(tensorwise, rowwise, transpose) -> None:
    from autopar.rules.registry import register

    register(tensorwise)(_tensorwise)
    register(rowwise)(_rowwise)
    register(transpose)(_transpose)


__all__ = ["register_rules"]
