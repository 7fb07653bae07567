"""References for FP8 tests and benchmarks: a one-device FP8 linear written directly with torch._scaled_mm and
the reference casts (independent of the planner and codegen), and a runner of a one-rank Program.

    ref = fp8_reference(model, rowwise=False, dtype=torch.float32)  # a copy whose linears run FP8
    runner = OneRank(model, inputs, loss_fn, config)                 # autopar's program on one rank
    loss = runner.step(*inputs)                                      # forward + backward, grads in .grad
"""
from __future__ import annotations

import copy
import fnmatch
from typing import Any, Callable, Sequence

import torch
from torch import nn

from autopar import _torch_compat as compat
from autopar.codegen.kernels import reference as ref
from autopar.config import DEFAULT_FP8_EXCLUDE
from autopar.models.corpus import synthetic_corpus


def _rows(x: torch.Tensor, fmt: str, rowwise: bool):
    return ref.cast_rowwise(x, fmt) if rowwise else ref.cast_tensorwise(x, fmt)


def fp8_matmul(a: torch.Tensor, b: torch.Tensor, a_fmt: str, b_fmt: str, rowwise: bool, out_dtype) -> torch.Tensor:
    """a @ b in FP8 as autopar lowers it: rows of a and of b^T cast (scales along the contraction dim when
    rowwise), then torch._scaled_mm."""
    with torch.autocast(a.device.type, enabled=False):
        ra, sa = _rows(a, a_fmt, rowwise)
        rb, sb = _rows(b.t(), b_fmt, rowwise)
        return compat.scaled_mm_op()(ra, rb.t(), sa, sb.t() if rowwise else sb, out_dtype=out_dtype)


class _Fp8Linear(torch.autograd.Function):
    """y = x @ w^T (+ b) with the three GEMMs in FP8: forward E4M3 x E4M3, grad_input = gy (E5M2) @ w, grad_weight
    = gy^T (E5M2) @ x, each operand cast as autopar casts it."""

    @staticmethod
    def forward(ctx, x, w, b, rowwise: bool, dtype):
        x2 = x.reshape(-1, x.shape[-1]).to(dtype)
        wc = w.to(dtype)
        ctx.save_for_backward(x2, wc)
        ctx.rowwise, ctx.shape, ctx.xdtype, ctx.has_bias = rowwise, x.shape, x.dtype, b is not None
        y = fp8_matmul(x2, wc.t(), "e4m3", "e4m3", rowwise, dtype)
        if b is not None:
            y = y + b.to(dtype)
        return y.view(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, gy):
        x2, wc = ctx.saved_tensors
        gy2 = gy.reshape(-1, gy.shape[-1]).to(x2.dtype)
        gw = fp8_matmul(gy2.t(), x2, "e5m2", "e4m3", ctx.rowwise, x2.dtype)
        gx = fp8_matmul(gy2, wc, "e5m2", "e4m3", ctx.rowwise, x2.dtype)
        gb = gy2.sum(0).float() if ctx.has_bias else None
        return gx.view(ctx.shape).to(ctx.xdtype), gw.float(), gb, None, None


class _RefLinear(nn.Module):
    def __init__(self, linear: nn.Linear, rowwise: bool, dtype: torch.dtype):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.rowwise, self.dtype = rowwise, dtype

    def forward(self, x):
        return _Fp8Linear.apply(x, self.weight, self.bias, self.rowwise, self.dtype)


def fp8_reference(model: nn.Module, rowwise: bool, dtype: torch.dtype,
                  exclude: Sequence[str] = DEFAULT_FP8_EXCLUDE) -> nn.Module:
    """A deep copy of `model` whose nn.Linear modules (but those `exclude` names) compute in FP8; `dtype`: the
    compute dtype (bf16 under mixed precision, where the rest of the model runs under autocast)."""
    out = copy.deepcopy(model)
    for name, mod in list(out.named_modules()):
        for cname, child in list(mod.named_children()):
            fqn = f"{name}.{cname}" if name else cname
            if isinstance(child, nn.Linear) and not any(fnmatch.fnmatchcase(fqn, p) for p in exclude):
                setattr(mod, cname, _RefLinear(child, rowwise, dtype))
    return out


class OneRank:
    """autopar's program of a one-rank mesh run in this process: `step(*inputs)` runs forward and backward and
    leaves each parameter's gradient in `.grad` (accumulating), returning the loss."""

    def __init__(self, model: nn.Module, inputs: Sequence[Any], loss_fn: Callable | None, config, plan=None):
        import autopar
        from autopar.compiler import compile_plan
        from autopar.program import RankSpec

        self.model = model
        mesh = autopar.fake_mesh((1,), ("dp",), "cpu")
        comp = compile_plan(model, mesh, tuple(inputs), loss_fn=loss_fn, config=config)
        self.plan = comp.plan
        self.program = comp.program(RankSpec.fake(("dp",), (1,)), plan)

    def step(self, *inputs: torch.Tensor) -> torch.Tensor:
        prog = self.program
        params = [self.model.get_parameter(n) for n in prog.param_names]
        buffers = [self.model.get_buffer(n) for n in prog.buffer_names]
        with torch.no_grad():
            out = prog.forward(*[p.detach() for p in params], *buffers, *inputs)
            saved = out[1 + len(prog.buffer_updates) + len(prog.outputs):]
            grads = prog.backward(*saved, torch.ones((), dtype=out[0].dtype))
        for p, g in zip(params, grads):
            if g is not None:
                p.grad = g.clone() if p.grad is None else p.grad + g
        return out[0].detach()


__all__ = ["fp8_matmul", "fp8_reference", "OneRank", "synthetic_corpus", "tracks", "train_one_rank"]


def tracks(reference: Sequence[float], fp8: Sequence[float], last: int = 20, within: float = 0.03) -> dict:
    """The convergence criterion: the FP8 run's mean loss over its last `last` steps is within `within` x the
    reference's initial loss of the reference's own mean, and no FP8 loss is non-finite or above its first."""
    import math

    ref_tail = sum(reference[-last:]) / len(reference[-last:])
    fp8_tail = sum(fp8[-last:]) / len(fp8[-last:])
    gap = abs(fp8_tail - ref_tail) / reference[0]
    diverged = any(not math.isfinite(x) or x > fp8[0] * 1.05 for x in fp8)
    return {"reference_tail": ref_tail, "fp8_tail": fp8_tail, "gap": gap, "diverged": diverged,
            "ok": gap <= within and not diverged}


def train_one_rank(model: nn.Module, batches: Sequence[torch.Tensor], loss_fn: Callable, config,
                   lr: float = 3e-3) -> list[float]:
    """AdamW steps of autopar's one-rank program over `batches`; the losses."""
    runner = OneRank(model, (batches[0],), loss_fn, config)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, eps=1e-6)
    losses = []
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        losses.append(runner.step(batch).item())
        opt.step()
    return losses
