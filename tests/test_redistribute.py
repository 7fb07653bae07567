"""Every layout change on a 2x2 mesh, simulated rank by rank: the planned steps give the right shards."""
from __future__ import annotations

import itertools

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar.layout import fmt_layout
from autopar.redistribute import plan_steps

SIZES = (2, 2)
PLACEMENTS = [Replicate(), Shard(0), Shard(1), Partial()]


def _shard_of(full: torch.Tensor, layout, coord, sizes=SIZES) -> torch.Tensor:
    """The local tensor of rank `coord` for `layout` (mesh-major nesting, as DTensor)."""
    t = full
    for axis, p in enumerate(layout):
        if isinstance(p, Shard):
            t = t.chunk(sizes[axis], dim=p.dim)[coord[axis]]
    return t


def _make_local(full, layout, coord, parts):
    t = _shard_of(full, layout, coord)
    for axis, p in enumerate(layout):
        if isinstance(p, Partial):  # random summands per axis; partials of several axes nest
            t = parts[(axis, coord[axis])](t)
    return t


def _run(steps, locals_, sizes=SIZES):
    coords = list(locals_)
    for st in steps:
        # A step over several axes (a flattened group) numbers its ranks row-major over them.
        groups: dict = {}
        for c in coords:
            key = tuple(c[i] for i in range(len(sizes)) if i not in st.axes)
            groups.setdefault(key, []).append(c)
        new = {}
        for members in groups.values():
            members.sort(key=lambda c: tuple(c[a] for a in st.axes))
            vals = [locals_[c] for c in members]
            n = len(members)
            for i, c in enumerate(members):
                if st.kind == "all_gather":
                    new[c] = torch.cat(vals, st.dim)
                elif st.kind == "all_reduce":
                    new[c] = sum(vals)
                elif st.kind == "reduce_scatter":
                    new[c] = sum(vals).chunk(n, st.dim)[i]
                elif st.kind == "all_to_all":
                    new[c] = torch.cat([v.chunk(n, st.dst_dim)[i] for v in vals], st.dim)
                elif st.kind == "chunk":
                    new[c] = locals_[c].chunk(n, st.dim)[i]
                elif st.kind == "partialize":
                    new[c] = locals_[c] if i == 0 else torch.zeros_like(locals_[c])
                else:
                    raise AssertionError(st)
        locals_ = new
    return locals_


LAYOUTS = list(itertools.product(PLACEMENTS, repeat=2))


def _check_every_transition(src, sizes, full):
    coords = list(itertools.product(*(range(n) for n in sizes)))
    for dst in itertools.product(PLACEMENTS, repeat=len(sizes)):
        if any(isinstance(p, Partial) for p in dst):
            continue  # targets are materialized layouts (partials are only produced by ops)
        # Partial sources: split the value into random summands along each partial axis.
        locals_ = {}
        for c in coords:
            t = _shard_of(full, src, c, sizes)
            for axis, p in enumerate(src):
                if isinstance(p, Partial):
                    t = t / sizes[axis] + (0.3 if c[axis] == 0 else -0.3 / (sizes[axis] - 1))
            locals_[c] = t
        out = _run(plan_steps(src, dst), locals_, sizes)
        for c in coords:
            want = _shard_of(full, dst, c, sizes)
            torch.testing.assert_close(out[c], want, msg=lambda m: f"{fmt_layout(src)} -> {fmt_layout(dst)} "
                                       f"at rank {c}: {m}")


@pytest.mark.parametrize("src", LAYOUTS, ids=fmt_layout)
def test_every_transition_on_a_2x2_mesh(src):
    torch.manual_seed(0)
    _check_every_transition(src, SIZES, torch.randn(8, 8, dtype=torch.float64))


def test_every_transition_on_a_2x3x2_mesh():
    """Three axes of unequal sizes: collectives over a flattened group of two or three axes (adjacent or not)
    number their ranks row-major over those axes, as the nesting of a dim sharded over them."""
    torch.manual_seed(0)
    full = torch.randn(12, 12, dtype=torch.float64)
    flat = set()
    for src in itertools.product(PLACEMENTS, repeat=3):
        _check_every_transition(src, (2, 3, 2), full)
        for dst in itertools.product(PLACEMENTS[:3], repeat=3):
            flat |= {st.axes for st in plan_steps(src, dst) if len(st.axes) > 1}
    assert flat == {(0, 1), (0, 2), (1, 2), (0, 1, 2)}
