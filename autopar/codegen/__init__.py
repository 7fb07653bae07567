"""Per-rank program generation: a Plan and the captured joint graph become local forward/backward graphs with
explicit functional collectives and local shapes."""
from __future__ import annotations

from autopar.capture import Captured
from autopar.codegen.builder import CodegenError, RankSpec
from autopar.codegen.collectives import collective_group, collective_kind
from autopar.codegen.lower import LocalJoint, lower
from autopar.codegen.partition import LocalProgram, split
from autopar.plan import Plan


def generate(plan: Plan, cap: Captured, rank: RankSpec) -> LocalProgram:
    """Lower `cap` under `plan` for one rank and split it into forward and backward graphs."""
    return split(lower(plan, cap, rank))


def collectives(gm, rank: RankSpec | None = None) -> list[tuple[str, str]]:
    """(kind, axis or group name) of every functional collective in a generated graph (or a list of its
    nodes), in program order."""
    out = []
    for n in (gm.graph.nodes if hasattr(gm, "graph") else gm):
        kind = collective_kind(n)
        if kind is not None:
            g = collective_group(n)
            out.append((kind, rank.axis_of_group(g) if rank is not None else g))
    return out


__all__ = ["CodegenError", "RankSpec", "LocalJoint", "LocalProgram", "generate", "lower", "split", "collectives"]
