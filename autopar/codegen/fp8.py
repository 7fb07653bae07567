"""Lower a matmul the plan runs as an FP8 variant: operand casts (autopar's kernels) + torch._scaled_mm.

    C = A @ B  ->  a, sa = cast(rows of A);  bt, sb = cast(rows of B^T)
                   C = _scaled_mm(a, bt.t(), sa, sb (rowwise: sb.t()), out_dtype=C's dtype) (+ bias)

_scaled_mm wants A row-major and B column-major, so each operand's cast writes the rows the GEMM reads: a plain
cast where the operand is already laid out that way, the cast-with-transpose kernel where it is the transpose
of a row-major tensor (the backward GEMMs read the forward's operands the other way round). Scales are
computed on the values this rank holds (the local shard), so a sharded operand gets one scale per shard;
rowwise scales run along the contraction dim. A rowwise GEMM whose second operand is the E5M2 gradient runs
transposed (C^T = B^T A^T), the one order CUDA's rowwise kernel takes. Under the FP8 all-gather variant the
FSDP-sharded weight is cast on its shard with the amax max-reduced over the gathering axes, gathered as bytes
and used with that one scale.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.distributed.tensor import Shard

from autopar import _torch_compat as compat
from autopar.codegen.builder import CodegenError
from autopar.codegen.collectives import VALUE_META, _c10d, checked_steps, redistribute, step_group
from autopar.codegen.kernels import FP8_CAST_ROWWISE, FP8_CAST_TENSORWISE, FP8_CAST_TRANSPOSE
from autopar.fp8.formats import DTYPES, E4M3, E5M2, dims_ok, formats_ok
from autopar.fp8.sites import GemmSite, gradient_nodes, site_of
from autopar.strategy import FP8_ROWWISE, FP8_TENSORWISE_AG

aten = torch.ops.aten


class Fp8Lowering:
    """The FP8 part of one rank's lowering (`low`: the codegen/lower.py _Lowering it serves)."""

    def __init__(self, low):
        self.low = low
        self._grads: set[fx.Node] | None = None
        self.gathered: dict[tuple, tuple[fx.Node, fx.Node]] = {}
        # One cast per (value, format, scaling, orientation, phase): the forward GEMMs of w1 and w3 read the same
        # normed activation, so do those of wq, wk and wv; each is cast once. (The planner prices every GEMM
        # with its own casts, an upper bound where they share one.)
        self.casts: dict[tuple, tuple[fx.Node, fx.Node]] = {}

    def site(self, node: fx.Node) -> GemmSite:
        if self._grads is None:
            self._grads = gradient_nodes(self.low.cap)
        site = site_of(self.low.cap, node, self._grads)
        if site is None:
            raise CodegenError(f"the plan runs {self.low.cap.names[node]} ({node.target}) in FP8, which this matmul "
                               "cannot take (not a 2-D matmul of a linear, or both operands are gradients); the plan "
                               "was made for another graph")
        return site

    # --- the FP8 all-gather of a weight ---------------------------------------------------------------------
    def gathers_weight(self, node: fx.Node, slot: int, a: fx.Node, dst) -> bool:
        """Whether input `slot` of `node` is a weight the plan gathers in FP8 (all-gathers only, from a
        parameter or its cast)."""
        np_ = self.low.node_plan(node)
        if np_.variant != FP8_TENSORWISE_AG or dst is None or self.site(node).weight != slot:
            return False
        return self._weight_steps(a, tuple(dst)) is not None

    def _weight_steps(self, a: fx.Node, dst: tuple):
        base = self.low._param_view(a)
        if base is None or self.low.layout_of(a) == dst:
            return None
        p, odd = base
        pdst = tuple(Shard(1 - q.dim) if isinstance(q, Shard) else q for q in dst) if odd else dst
        steps = checked_steps(self.low.layout_of(p), pdst)
        if not steps or any(st.kind != "all_gather" for st in steps):
            return None
        return p, odd, pdst, steps

    def gather_weight(self, a: fx.Node, dst, phase: str, what: str) -> tuple[fx.Node, fx.Node]:
        """(FP8 weight in the layout the matmul reads, as the operand it is; its 0-d inverse scale)."""
        p, odd, pdst, steps = self._weight_steps(a, tuple(dst))
        key = (p, pdst, phase)
        if key not in self.gathered:
            b, rank = self.low.b, self.low.rank
            shard = self.low._value(p)
            amax = b.call(aten.amax.default, (b.call(aten.abs.default, (shard,), phase=phase),), phase=phase)
            c10d = _c10d()
            for st in steps:  # one scale for the gathered tensor: the max of the shards' amaxes
                red = b.call(c10d.all_reduce.default, (amax, "max", step_group(rank, st)), phase=phase,
                             name="all_reduce_amax_" + "_".join(rank.axis_names[a] for a in st.axes))
                red.meta[VALUE_META] = f"the FP8 amax of {what}"
                amax = b.call(c10d.wait_tensor.default, (red,), phase=phase)
            data, inv = _pair(b, FP8_CAST_TENSORWISE, (shard, E4M3, amax), phase)
            raw = b.call(aten.view.dtype, (data, torch.uint8), phase=phase)
            full = redistribute(b, raw, self.low.layout_of(p), pdst, rank, phase, hint="fp8", what=f"{what} in FP8")
            full = b.call(aten.view.dtype, (full, DTYPES[E4M3]), phase=phase)
            self.gathered[key] = (b.call(aten.t.default, (full,), phase=phase) if odd else full, inv)
        return self.gathered[key]

    # --- the matmul -----------------------------------------------------------------------------------------
    def emit(self, node: fx.Node, args: list, phase: str) -> fx.Node:
        """The local FP8 matmul for `node` whose local tensor arguments are `args` (a gathered FP8 weight comes
        as its (data, inverse scale) pair)."""
        low, b = self.low, self.low.b
        np_ = low.node_plan(node)
        site = self.site(node)
        rowwise = np_.variant == FP8_ROWWISE
        tensors = [x for x in args if not isinstance(x, (int, float))]
        a, bb = tensors[site.a], tensors[site.b]
        m, k = _shape(a)
        n = _shape(bb)[1]
        a_fmt, b_fmt = site.a_fmt, site.b_fmt
        swap = rowwise and b_fmt == E5M2 and a_fmt == E4M3
        if not dims_ok(m, k, n) or not formats_ok(*((b_fmt, a_fmt) if swap else (a_fmt, b_fmt)), rowwise,
                                                   site.out_dtype):
            raise CodegenError(f"{low.cap.names[node]}: the plan runs it as {np_.variant} but its local GEMM "
                               f"({m} x {k}) @ ({k} x {n}) does not meet torch._scaled_mm's rules (dims multiple of "
                               "16, formats); the plan was made for another mesh or graph")
        ra, sa = self._rows(a, a_fmt, rowwise, phase, transposed=False)  # rows of A
        rb, sb = self._rows(bb, b_fmt, rowwise, phase, transposed=True)  # rows of B^T
        if swap:  # C^T = B^T @ A^T: the E5M2 gradient first
            ra, sa, rb, sb = rb, sb, ra, sa
        t = lambda x: b.call(aten.t.default, (x,), phase=phase)  # noqa: E731
        out = b.call(compat.scaled_mm_op(), (ra, t(rb), sa, t(sb) if rowwise else sb),
                     {"out_dtype": site.out_dtype, "use_fast_accum": phase == "fwd"}, phase=phase)
        if swap:
            out = t(out)
        if node.target is aten.addmm.default:
            out = b.call(aten.add.Tensor, (out, tensors[0]), phase=phase)
        return out

    def _rows(self, x, fmt: str, rowwise: bool, phase: str, transposed: bool) -> tuple[fx.Node, fx.Node]:
        """FP8 rows of x (transposed: of x^T), C-contiguous, with their inverse scale(s)."""
        b = self.low.b
        if isinstance(x, tuple):  # an FP8-gathered weight: (data as the operand, one scale)
            data, inv = x
            want = b.call(aten.t.default, (data,), phase=phase) if transposed else data
            if not want.meta["val"].is_contiguous():
                want = b.call(aten.clone.default, (want,), {"memory_format": torch.contiguous_format}, phase=phase)
            return want, inv
        key = (x, fmt, rowwise, transposed, phase)
        if key not in self.casts:
            self.casts[key] = self._cast_rows(x, fmt, rowwise, phase, transposed)
        return self.casts[key]

    def _cast_rows(self, x: fx.Node, fmt: str, rowwise: bool, phase: str, transposed: bool):
        b = self.low.b
        val = x.meta["val"]
        if transposed:
            val = val.t()
        if val.is_contiguous() or not val.t().is_contiguous():
            src = b.call(aten.t.default, (x,), phase=phase) if transposed else x
            return _pair(b, FP8_CAST_ROWWISE if rowwise else FP8_CAST_TENSORWISE, (src, fmt), phase)
        # The rows wanted are the columns of a row-major tensor: cast it with the transpose.
        base = x if transposed else b.call(aten.t.default, (x,), phase=phase)
        return _pair(b, FP8_CAST_TRANSPOSE, (base, fmt, rowwise), phase)


def _pair(b, op, args: tuple, phase: str) -> tuple[fx.Node, fx.Node]:
    out = b.call(op, args, phase=phase)
    return (b.call(operator.getitem, (out, 0), phase=phase), b.call(operator.getitem, (out, 1), phase=phase))


def _shape(x) -> tuple[int, ...]:
    v = (x[0] if isinstance(x, tuple) else x).meta["val"]
    return tuple(int(s) for s in v.shape)


__all__ = ["Fp8Lowering"]
