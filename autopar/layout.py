"""Placements on one mesh axis and layouts over all axes: parsing, printing and local shapes."""
from __future__ import annotations

import math
import re
from typing import Sequence

from torch.distributed.tensor import Partial, Placement, Replicate, Shard

R = Replicate()
P = Partial()  # sum
P_AVG = Partial("avg")

Layout = tuple  # tuple[Placement, ...], one entry per mesh axis in mesh order


def transpose_layout(layout: Sequence[Placement]) -> Layout:
    """The layout of t(x) given x's layout, and back (2-D: dims 0 and 1 swap)."""
    return tuple(Shard(1 - p.dim) if isinstance(p, Shard) else p for p in layout)


def S(dim: int) -> Shard:
    return Shard(dim)


def fmt(p: Placement) -> str:
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Partial):
        return "P" if p.reduce_op == "sum" else f"P({p.reduce_op})"
    return "R"


def fmt_layout(layout: Sequence[Placement]) -> str:
    return ",".join(fmt(p) for p in layout)


_RE = re.compile(r"^(R|P|S\((-?\d+)\)|P\((\w+)\))$")


def parse(text: str) -> Placement:
    m = _RE.match(text.strip())
    if not m:
        raise ValueError(f"cannot parse placement {text!r}: expected R, P, P(avg) or S(dim)")
    if m.group(2) is not None:
        return Shard(int(m.group(2)))
    if m.group(3) is not None:
        return Partial(m.group(3))
    return R if m.group(1) == "R" else P


def parse_layout(text: str) -> Layout:
    return tuple(parse(t) for t in text.split(",")) if text else ()


def is_shard(p: Placement, dim: int | None = None) -> bool:
    return isinstance(p, Shard) and (dim is None or p.dim == dim)


def is_partial(p: Placement) -> bool:
    return isinstance(p, Partial)


def shard_factor(layout: Sequence[Placement], axis_sizes: Sequence[int], dim: int) -> int:
    return math.prod(n for p, n in zip(layout, axis_sizes) if is_shard(p, dim))


def local_shape(shape: Sequence[int], layout: Sequence[Placement], axis_sizes: Sequence[int]) -> tuple[int, ...]:
    """Per-rank shape; callers guarantee even division (the planner drops uneven layouts)."""
    out = list(shape)
    for p, n in zip(layout, axis_sizes):
        if isinstance(p, Shard):
            out[p.dim] //= n
    return tuple(out)


def divides(shape: Sequence[int], layout: Sequence[Placement], axis_sizes: Sequence[int]) -> bool:
    cur = list(shape)
    for p, n in zip(layout, axis_sizes):
        if isinstance(p, Shard):
            if p.dim >= len(cur) or cur[p.dim] % n:
                return False
            cur[p.dim] //= n
    return True
