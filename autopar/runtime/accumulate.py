"""Gradient accumulation: one training step over several microbatches, gradients reduced once per step.

Each microbatch runs the Program's forward and backward (whose gradients leave in the layouts they are produced
in, without collectives); the gradients accumulate locally, are scaled so the step equals the full batch's, and
the Program's `grad_sync` graph reduces them once into the parameters' `.grad`.

The weights (autopar.microbatch.REDUCTIONS): a loss that is numerator / count (cross_entropy, nll_loss) gets its
count as each microbatch's tangent, and the sums are divided by the step's total count, so the step's loss and
gradients are those of the full batch normalized by its global number of counted tokens (labels of -100
excluded) however the padding falls into microbatches. A microbatch without a counted token adds nothing (its
numerator is an empty sum; its own loss, 0 / 0, is not used) and its backward is skipped. A plain sum adds up;
anything else is averaged over the equal microbatches.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from autopar import _torch_compat as compat
from autopar.microbatch import check_divides
from autopar.program import Program
from autopar.runtime.state import as_dtensor


def step_microbatches(pm: Any, prog: Program, runner: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    """Forward and backward of every microbatch of the global batch (args, kwargs), gradients reduced once and
    added into each parameter's `.grad`; returns the step's loss (detached, replicated)."""
    m = prog.microbatches
    params = [pm.get_parameter(f) for f in prog.param_names]
    local_params = [compat.dtensor_local(p) for p in params]
    buffers = [b.to_local() if isinstance(b, DTensor) else b for b in (pm.get_buffer(f) for f in prog.buffer_names)]
    acc: dict[str, torch.Tensor] = {}
    total_loss = total_weight = None
    with torch.no_grad():
        for mb_args, mb_kwargs in _microbatches(pm, prog, args, kwargs):
            inputs = pm._local_inputs(mb_args, mb_kwargs)
            seed = pm._next_seed(prog, runner.seed_as_tensor)
            loss, _, count, saved = runner.forward(*local_params, *buffers, *inputs, *seed)
            weight = count.to(loss.dtype).reshape(loss.shape) if count is not None else torch.ones_like(loss)
            if count is not None and not bool(count != 0):
                total_weight = weight if total_weight is None else total_weight + weight
                continue  # no counted token: an empty sum, nothing to differentiate
            total_loss = loss * weight if total_loss is None else total_loss + loss * weight
            total_weight = weight if total_weight is None else total_weight + weight
            grads = runner.backward(*saved, weight.contiguous())
            for fqn, g in zip(prog.param_names, grads):
                if g is not None:
                    acc[fqn] = g if fqn not in acc else acc[fqn] + g
            del saved, grads
        scale = {"count": 1 / total_weight if total_weight is not None else None, "sum": 1.0,
                 "mean": 1.0 / m}[prog.loss_reduction]
        if total_loss is None:  # every microbatch was empty: the full batch's loss is 0 / 0 as well
            return torch.full((), float("nan"), device=pm._device)
        synced = runner.grad_sync(*[_scaled(acc.get(f), scale, prog, i, pm._device)
                                    for i, f in enumerate(prog.synced)])
        by_name = dict(zip(prog.param_names, params))
        for fqn, g in zip(prog.synced, synced):
            p = by_name[fqn]
            grad = compat.dtensor_like(g, p)
            if p.grad is None:
                p.grad = grad
            else:
                p.grad += grad
    return (total_loss * scale).detach()


def _scaled(g: torch.Tensor | None, scale, prog: Program, i: int, device: torch.device) -> torch.Tensor:
    """An accumulated gradient times the step's scale; zeros (of grad_sync's i-th input) when no microbatch
    produced one."""
    if g is None:
        ph = [n for n in prog.grad_sync.graph.nodes if n.op == "placeholder"][i]
        val = ph.meta["val"]
        return torch.zeros(tuple(val.shape), dtype=val.dtype, device=device)
    return g * scale


def _microbatches(pm: Any, prog: Program, args: tuple, kwargs: dict) -> list[tuple[tuple, dict]]:
    """The global batch split into the plan's microbatches along dim 0 (autopar.microbatch.split_batch). A
    DTensor input (laid out as pm.input_placements says, for the global batch) is split on its local shard:
    each rank's rows of the step are divided into microbatches, which changes which rows share a microbatch,
    not the step's sums."""
    m = prog.microbatches
    leaves, spec = compat.tree_flatten((args, kwargs))
    plain = [torch.empty(0) if isinstance(x, DTensor) else x for x in leaves]
    check_divides(tuple(plain), {}, m)
    layouts = {i.leaf: i for i in prog.inputs}
    pieces = []
    for idx, x in enumerate(leaves):
        if isinstance(x, DTensor):
            want = layouts.get(idx)
            local = x.to_local()
            if want is None or tuple(x.placements) != tuple(want.layout) or local.shape[0] % m:
                raise ValueError(f"input {idx} is a DTensor with placements {tuple(x.placements)} and "
                                 f"{local.shape[0]} local rows; the plan lays it out as "
                                 f"{tuple(want.layout) if want else 'no input'} (see pm.input_placements) and "
                                 f"splits it into {m} microbatches")
            pieces.append([as_dtensor(c.contiguous(), pm.mesh, tuple(x.placements), want.shape)
                           for c in local.chunk(m, 0)])
        elif isinstance(x, torch.Tensor) and x.ndim >= 1:
            pieces.append(list(x.chunk(m, 0)))
        else:
            pieces.append([x] * m)
    out = []
    for k in range(m):
        a, kw = compat.tree_unflatten([p[k] for p in pieces], spec)
        out.append((tuple(a), dict(kw)))
    return out
