"""Microbatches: how a global batch splits into equal microbatches along dim 0, and how the microbatches'
losses and gradients add up to the full batch's."""
from __future__ import annotations

from typing import Any

import torch
import torch.fx

from autopar import _torch_compat as compat

# How a captured loss combines over microbatches (Captured.loss_reduction):
#   "count": loss = numerator / count, with a count computed from the inputs alone (cross_entropy and nll_loss
#            as capture decomposes them: the number of labels other than ignore_index). The step's loss is
#            sum(numerators) / sum(counts); each microbatch's backward gets its count as the tangent and the
#            accumulated gradients are divided by the total count, so padded batches weigh as on one device.
#   "sum":   a plain total (aten.sum): microbatch losses and gradients add up.
#   "mean":  anything else is taken as a mean over the batch: losses and gradients are averaged over the
#            (equal) microbatches.
REDUCTIONS = ("count", "sum", "mean")


def loss_reduction(cap: Any) -> tuple[str, Any]:
    """How a captured loss (autopar.capture.Captured) adds up over microbatches: ("count", the count node) when
    the loss is numerator / count with a count read from the inputs alone (the decomposed cross_entropy and
    nll_loss), ("sum", None) for a plain total, else ("mean", None)."""
    aten = torch.ops.aten
    loss = cap.loss
    if loss.op != "call_function":
        return "mean", None
    if loss.target is aten.div.Tensor and isinstance(loss.args[1], torch.fx.Node):
        den = loss.args[1]
        seen, stack = set(), [den]
        while stack:
            n = stack.pop()
            if n not in seen:
                seen.add(n)
                stack.extend(n.all_input_nodes)
        sources = {n for n in seen if n.op == "placeholder"}
        if sources and sources <= set(cap.inputs):
            return "count", den
    if loss.target is aten.sum.default:
        return "sum", None
    return "mean", None


def batch_rows(args: tuple, kwargs: dict) -> int | None:
    """Dim 0 of the first tensor input with at least one dim (the batch), or None."""
    for x in compat.tree_leaves((args, kwargs)):
        if isinstance(x, torch.Tensor) and x.ndim >= 1:
            return int(x.shape[0])
    return None


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_divides(args: tuple, kwargs: dict, m: int) -> None:
    """ValueError unless every tensor input with a dim splits into `m` equal parts along dim 0."""
    for i, x in enumerate(compat.tree_leaves((args, kwargs))):
        if isinstance(x, torch.Tensor) and x.ndim >= 1 and x.shape[0] % m:
            raise ValueError(f"microbatches={m} does not divide the batch: input {i} has {x.shape[0]} rows along "
                             f"dim 0; choose a divisor of {x.shape[0]} ({', '.join(map(str, divisors(int(x.shape[0]))))}) "
                             "or Config(microbatches='auto')")


def split_batch(args: tuple, kwargs: dict, m: int) -> list[tuple[tuple, dict]]:
    """The `m` microbatches of (args, kwargs): every tensor with a dim split into equal chunks along dim 0 (as
    torch.distributed.pipelining splits a batch), every other value passed to each microbatch as it is."""
    check_divides(args, kwargs, m)
    leaves, spec = compat.tree_flatten((args, kwargs))
    chunks = [x.chunk(m, 0) if isinstance(x, torch.Tensor) and x.ndim >= 1 else None for x in leaves]
    out = []
    for k in range(m):
        mb = [c[k] if c is not None else x for x, c in zip(leaves, chunks)]
        a, kw = compat.tree_unflatten(mb, spec)
        out.append((tuple(a), dict(kw)))
    return out


def first_microbatch(args: tuple, kwargs: dict | None, m: int) -> tuple[tuple, dict]:
    """The inputs of one microbatch (what capture traces when the plan has `m` microbatches)."""
    if m == 1:
        return tuple(args), dict(kwargs or {})
    return split_batch(tuple(args), dict(kwargs or {}), m)[0]


__all__ = ["REDUCTIONS", "loss_reduction", "batch_rows", "divisors", "check_divides", "split_batch", "first_microbatch"]
