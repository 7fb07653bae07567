"""Which matmuls of a captured step may run in FP8, and the role of each operand.

A site is a 2-D matmul (`mm`, or `addmm` with a 1-D bias) in a linear-like module, i.e. a module whose forward
matmul reads a 2-D parameter (an nn.Linear, a GPT-2 Conv1D, a head tied to the embedding): its forward GEMM and
the two backward GEMMs autograd derived from it (grad_input, grad_weight). A module named by an exclusion
pattern (Fp8Config.exclude) has no sites. An operand derived from the loss tangent is a gradient (cast to E5M2),
any other to E4M3; a GEMM of two gradients has no FP8 form (_scaled_mm refuses E5M2 x E5M2).
"""
from __future__ import annotations

import dataclasses
import fnmatch

import torch
import torch.fx as fx

from autopar.fp8.formats import E4M3, E5M2

aten = torch.ops.aten
_MATMULS = (aten.mm.default, aten.addmm.default)


@dataclasses.dataclass(frozen=True)
class GemmSite:
    """One FP8-capable matmul: C = A @ B (+ bias), A (m, k) and B (k, n) at tensor input slots `a` and `b`.

    a_fmt, b_fmt: FP8 formats of A and B. a_t: A is a transposed view (its cast writes A's rows from a
    column-major input: a transposed cast); b_t: B is row-major, so the copy the GEMM wants (B^T's rows) is a
    transposed cast. weight: the tensor slot of the operand computed from a parameter alone (None if neither),
    weight_fqn its parameter. out_dtype: the matmul's output dtype. module: the module FQN (block-relative)."""

    a: int
    b: int
    a_fmt: str
    b_fmt: str
    a_t: bool
    b_t: bool
    weight: int | None
    weight_fqn: str | None
    out_dtype: torch.dtype
    module: str
    phase: str


def find_sites(ctx, exclude: tuple[str, ...]) -> dict[str, GemmSite]:
    """Plan key -> GemmSite for every FP8-capable matmul key of the captured graph."""
    cap = ctx.captured
    grads = gradient_nodes(cap)
    linear_modules = {cap.module_of.get(n) for n in cap.gm.graph.nodes
                      if n.op == "call_function" and n.target in _MATMULS and cap.phase.get(n) == "fwd"
                      and _weight_of(cap, n) is not None}
    linear_modules.discard(None)
    sites = {}
    for key, nodes in ctx.members.items():
        node = nodes[0]
        if node.op != "call_function" or node.target not in _MATMULS:
            continue
        module = cap.module_of.get(node)
        if module not in linear_modules or _excluded(module, cap.block_relative(module), exclude):
            continue
        site = site_of(cap, node, grads)
        if site is not None:
            sites[key] = site
    return sites


def _excluded(module: str, relative: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(module, p) or fnmatch.fnmatchcase(relative, p) for p in patterns)


def _operands(node: fx.Node) -> tuple[int, int, fx.Node, fx.Node] | None:
    """(slot of A, slot of B, A, B) among the node's tensor inputs; None for an addmm FP8 cannot take."""
    if node.target is aten.mm.default:
        return 0, 1, node.args[0], node.args[1]
    bias = node.args[0]
    beta, alpha = node.kwargs.get("beta", 1), node.kwargs.get("alpha", 1)
    if beta != 1 or alpha != 1 or bias.meta["val"].dim() != 1:
        return None
    return 1, 2, node.args[1], node.args[2]


def site_of(cap, node: fx.Node, grads: set[fx.Node]) -> GemmSite | None:
    """The GemmSite of a matmul node (`grads`: gradient_nodes(cap)), None if it has no FP8 form; the module and
    exclusion checks are find_sites'."""
    ops = _operands(node)
    if ops is None:
        return None
    ia, ib, a, b = ops
    va, vb, out = a.meta["val"], b.meta["val"], node.meta["val"]
    if va.dim() != 2 or vb.dim() != 2 or not all(v.dtype.is_floating_point for v in (va, vb, out)):
        return None
    a_grad, b_grad = a in grads, b in grads
    if a_grad and b_grad:
        return None
    weight = _weight_of(cap, node)
    module = cap.block_relative(cap.module_of.get(node) or "")
    slot = fqn = None
    if weight is not None and not (a_grad if weight[0] == 0 else b_grad):
        slot, fqn = (ia if weight[0] == 0 else ib), weight[1]
    return GemmSite(a=ia, b=ib, a_fmt=E5M2 if a_grad else E4M3, b_fmt=E5M2 if b_grad else E4M3,
                    a_t=not va.is_contiguous() and va.t().is_contiguous(), b_t=not vb.t().is_contiguous(),
                    weight=slot, weight_fqn=fqn, out_dtype=out.dtype, module=module, phase=cap.phase[node])


def _weight_of(cap, node: fx.Node) -> tuple[int, str] | None:
    """(0 for A or 1 for B, parameter FQN) of an operand that is a 2-D parameter, seen through transposes and
    dtype casts (as mixed precision captures a weight); None when neither operand is."""
    ops = _operands(node) if node.target in _MATMULS else None
    if ops is None:
        return None
    params = {n: f for f, n in cap.params.items()}
    for i, x in enumerate(ops[2:]):
        while x not in params and x.op == "call_function" and len(x.all_input_nodes) == 1 and (
                x.target is aten.t.default or (x.target is aten._to_copy.default and set(x.kwargs) <= {"dtype"})):
            x = x.all_input_nodes[0]
        if x in params and x.meta["val"].dim() == 2:
            return i, params[x]
    return None


def gradient_nodes(cap) -> set[fx.Node]:
    """Every value computed from the loss tangent (the backward's gradients)."""
    found = set(cap.tangents)
    for n in cap.gm.graph.nodes:
        if n.op == "call_function" and any(a in found for a in n.all_input_nodes):
            found.add(n)
    return found


__all__ = ["GemmSite", "find_sites", "site_of", "gradient_nodes"]
