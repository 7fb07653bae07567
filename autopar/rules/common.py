"""Building blocks shared by the rule families: dim normalization, broadcasting, dim maps and Partial pass-through."""
from __future__ import annotations

from typing import Iterable

from torch.distributed.tensor import Placement

from autopar.layout import P, P_AVG, R, S
from autopar.rules.base import AxisStrategy, OpInfo, TensorMeta

# Partial(sum) and Partial(avg): a map that is linear in its Partial inputs preserves either one.
PARTIALS = (P, P_AVG)


def norm_dim(d: int, ndim: int) -> int:
    """A possibly negative dim as 0..ndim-1 (a 0-d tensor accepts dim 0 and -1)."""
    return d % ndim if ndim else 0


def arg(info: OpInfo, pos: int, name: str, default=None):
    """A non-tensor argument given positionally or by keyword."""
    if len(info.args) > pos:
        return info.args[pos]
    return info.kwargs.get(name, default)


def bcast(meta: TensorMeta | None, out_dim: int, out_ndim: int) -> Placement:
    """Placement of a broadcasting input when the output is sharded on `out_dim`: the aligned dim, or R where the
    input lacks the dim or has size 1 there (dims align from the right)."""
    if meta is None:
        return R
    d = out_dim - (out_ndim - meta.ndim)
    return S(d) if d >= 0 and meta.shape[d] > 1 else R


def elementwise(info: OpInfo, out_index: int = 0) -> list[AxisStrategy]:
    """Shard any output dim; every input follows it with broadcasting; every output is sharded alike."""
    out = info.outputs[out_index]
    res = []
    for d in range(out.ndim):
        ins = tuple(bcast(m, d, out.ndim) for m in info.inputs)
        res.append(AxisStrategy(ins, (S(d),) * len(info.outputs)))
    return res


def dim_map(info: OpInfo, mapping: dict[int, int], *, new_dims: Iterable[int] = (),
            linear: bool = True) -> list[AxisStrategy]:
    """Layout ops moving input 0 (other inputs R): S(i) -> S(mapping[i]) on every output; R -> S(j) for output
    dims `new_dims` created from nothing; with `linear`, Partial passes through (moving values is linear)."""
    n_out = len(info.outputs)
    extra = (R,) * (len(info.inputs) - 1)
    res = [AxisStrategy((S(i),) + extra, (S(j),) * n_out) for i, j in sorted(mapping.items())]
    res += [AxisStrategy((R,) + extra, (S(j),) * n_out) for j in new_dims]
    if linear:
        res += partial_through(info, (0,))
    return res


def partial_through(info: OpInfo, partial_inputs: Iterable[int]) -> list[AxisStrategy]:
    """The op is linear in `partial_inputs` jointly (the other inputs held fixed): the same Partial on those inputs
    (R on the others) gives that Partial on every output."""
    chosen = set(partial_inputs)
    res = []
    for p in PARTIALS:
        ins = tuple(p if i in chosen else R for i in range(len(info.inputs)))
        res.append(AxisStrategy(ins, (p,) * len(info.outputs)))
    return res


def each_partial(info: OpInfo, candidates: Iterable[int]) -> list[AxisStrategy]:
    """Multilinear ops: Partial on any one of `candidates` (others R) gives Partial."""
    res = []
    for i in candidates:
        res += partial_through(info, (i,))
    return res
