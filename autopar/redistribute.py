"""The steps that turn one layout into another: collectives and local slices, per mesh axis.

The planner prices these steps and codegen emits exactly them, so the cost model and the generated program
never disagree. Layouts nest in mesh order: when two axes shard the same tensor dim, the lower axis splits
first (outer chunks), as DTensor does.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

from torch.distributed.tensor import Partial, Placement, Replicate, Shard


R = Replicate()


@dataclasses.dataclass(frozen=True)
class Step:
    """One change on one mesh axis, or on several at once. kind: all_gather | all_reduce | reduce_scatter |
    all_to_all (communication), chunk | partialize | rescale (local). `dim`/`dst_dim` are tensor dims; `op` a
    reduce op. A collective over several axes (`flat`, in mesh order; `axis` is the first) runs once over their
    flattened group, whose ranks are numbered row-major over those axes: the nesting of a dim sharded over
    them, so one all_gather (reduce_scatter) over the group gathers (scatters) what one per axis would."""

    kind: str
    axis: int
    dim: int | None = None
    dst_dim: int | None = None
    op: str | None = None
    factor: float | None = None
    flat: tuple[int, ...] = ()

    @property
    def axes(self) -> tuple[int, ...]:
        """The mesh axes the step runs over (one, or a flattened group's)."""
        return self.flat or (self.axis,)

    @property
    def is_comm(self) -> bool:
        return self.kind in ("all_gather", "all_reduce", "reduce_scatter", "all_to_all")

    def ranks(self, sizes: Sequence[int]) -> int:
        """How many ranks the step runs over on a mesh of `sizes`."""
        return math.prod(sizes[a] for a in self.axes)

    def describe(self, axis_names: Sequence[str]) -> str:
        ax = "+".join(axis_names[a] for a in self.axes)
        if self.kind == "all_to_all":
            return f"all_to_all[{ax}] S({self.dim})->S({self.dst_dim})"
        if self.kind in ("all_gather", "chunk"):
            return f"{self.kind}[{ax}] dim {self.dim}"
        if self.kind == "reduce_scatter":
            return f"reduce_scatter[{ax}] dim {self.dim}"
        return f"{self.kind}[{ax}]"


def _shards_dim(layout: Sequence[Placement], dim: int, after: int) -> list[int]:
    return [b for b in range(after + 1, len(layout)) if isinstance(layout[b], Shard) and layout[b].dim == dim]


def _dims_of(p: Placement) -> list[int]:
    return [p.dim] if isinstance(p, Shard) else []


def after_step(layout: Sequence[Placement], st: Step) -> tuple[Placement, ...]:
    """The layout `st` leaves from `layout`."""
    new = {"all_gather": R, "all_reduce": R, "chunk": Shard(st.dim) if st.dim is not None else R,
           "reduce_scatter": Shard(st.dim) if st.dim is not None else R,
           "all_to_all": Shard(st.dst_dim) if st.dst_dim is not None else R}.get(st.kind)
    if new is None:  # partialize, rescale: a partial value of the same size
        new = Partial(st.op) if st.kind == "partialize" else Partial("sum" if st.op == "avg_to_sum" else "avg")
    out = list(layout)
    for a in st.axes:
        out[a] = new
    return tuple(out)


def plan_steps(src: Sequence[Placement], dst: Sequence[Placement]) -> list[Step]:
    """Steps from `src` to `dst` (one placement per mesh axis). Partial-to-Shard uses reduce_scatter and
    Shard-to-Shard all_to_all when the nesting allows it; otherwise a dim is gathered and re-chunked. Where
    several axes gather one dim they shard together (or reduce, or reduce and scatter one dim), the step runs
    once over their flattened group (Step.flat)."""
    return list(_flattened(_plan_steps(tuple(src), tuple(dst))))


@functools.lru_cache(maxsize=65536)
def _flattened(steps: tuple[Step, ...]) -> tuple[Step, ...]:
    """`steps` with each run of per-axis collectives that one collective over the axes' flattened group does
    merged into it: all_gathers of one dim, inner axis first (the dim's nesting unwound); all_reduces of one
    op; and such an all_reduce followed by a chunk of one dim on each of its axes (a reduce_scatter)."""
    out: list[Step] = []
    for st in steps:
        last = out[-1] if out else None
        if last is not None and st.kind == last.kind and st.op == last.op and st.axis < min(last.axes) and (
                (st.kind == "all_gather" and st.dim == last.dim) or st.kind == "all_reduce"):
            out[-1] = dataclasses.replace(st, flat=(st.axis, *last.axes))
        else:
            out.append(st)
    # A partial sum reduced over a flattened group and chunked on each of its axes, outer first, on one dim:
    # one reduce_scatter over the group.
    i = 0
    while i < len(out):
        st = out[i]
        k = len(st.flat)
        chunks = out[i + 1:i + 1 + k]
        if (k and st.kind == "all_reduce" and len(chunks) == k and all(c.kind == "chunk" for c in chunks)
                and tuple(c.axis for c in chunks) == st.flat and len({c.dim for c in chunks}) == 1):
            out[i:i + 1 + k] = [dataclasses.replace(st, kind="reduce_scatter", dim=chunks[0].dim)]
        i += 1
    return tuple(out)


@functools.lru_cache(maxsize=65536)
def _plan_steps(src: tuple[Placement, ...], dst: tuple[Placement, ...]) -> tuple[Step, ...]:
    if src == dst:
        return ()
    n = len(src)
    # Axes to go through (or directly to) their target: changed axes, plus later axes that shard a dim an
    # earlier changed axis touches (they nest inside it and must be undone first).
    touch = {a for a in range(n) if src[a] != dst[a]}
    changed = True
    while changed:
        changed = False
        for a in sorted(touch):
            for d in _dims_of(src[a]) + _dims_of(dst[a]):
                for b in _shards_dim(src, d, a) + _shards_dim(dst, d, a):
                    if b not in touch:
                        touch.add(b)
                        changed = True
    cur = list(src)
    steps: list[Step] = []

    def blocked(a: int, dim: int) -> bool:
        # Sharding `dim` directly on axis a is only valid if no other axis will still have to undo a shard
        # of that dim around it: earlier touched axes change later in this loop, later ones nest inside.
        return (any(b in touch and cur[b] != dst[b] and dim in _dims_of(cur[b]) + _dims_of(dst[b])
                    for b in range(a))
                or any(isinstance(cur[b], Shard) and cur[b].dim == dim for b in range(a + 1, n))
                or bool(_shards_dim(dst, dim, a)))

    for a in sorted(touch, reverse=True):
        s, t = cur[a], dst[a]
        if isinstance(s, Shard):
            if isinstance(t, Shard) and t.dim != s.dim and not blocked(a, t.dim) and not any(
                    isinstance(cur[b], Shard) and cur[b].dim == s.dim for b in range(a + 1, n)):
                steps.append(Step("all_to_all", a, s.dim, t.dim))
                cur[a] = t
            else:
                steps.append(Step("all_gather", a, s.dim))
                cur[a] = R
        elif isinstance(s, Partial):
            if isinstance(t, Partial):
                steps.append(_rescale(a, s, t))
                cur[a] = t
            elif isinstance(t, Shard) and not blocked(a, t.dim):
                steps.append(Step("reduce_scatter", a, t.dim, op=s.reduce_op))
                cur[a] = t
            else:
                steps.append(Step("all_reduce", a, op=s.reduce_op))
                cur[a] = R
    for a in range(n):
        if cur[a] == dst[a]:
            continue
        assert isinstance(cur[a], Replicate), (src, dst, cur)
        t = dst[a]
        if isinstance(t, Shard):
            steps.append(Step("chunk", a, t.dim))
        else:
            steps.append(Step("partialize", a, op=t.reduce_op))
        cur[a] = t
    return tuple(steps)


def _rescale(axis: int, s: Partial, t: Partial) -> Step:
    # A sum-partial holds values whose sum is the tensor; an avg-partial values whose mean is.
    if s.reduce_op == "avg" and t.reduce_op == "sum":
        return Step("rescale", axis, op="avg_to_sum")
    if s.reduce_op == "sum" and t.reduce_op == "avg":
        return Step("rescale", axis, op="sum_to_avg")
    raise ValueError(f"cannot convert Partial({s.reduce_op}) to Partial({t.reduce_op})")


def describe_steps(steps: Sequence[Step], axis_names: Sequence[str]) -> str:
    return "; ".join(s.describe(axis_names) for s in steps) or "none"
