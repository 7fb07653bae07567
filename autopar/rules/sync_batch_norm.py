"""Training batch norm written as per-channel sums, so that a batch-sharded input normalizes with the statistics
of the whole global batch (what SyncBatchNorm computes), for a capture that applies `DECOMPOSITIONS`.

The fused kernels (`_native_batch_norm_legit_functional`, `native_batch_norm_backward`) shard channels only
(norms.py): a rule cannot place a collective inside an op. Written out, the statistics are sums over the batch
and spatial dims divided by the global count (the captured graph has global shapes), which the existing rules
shard: a batch-sharded `sum` gives a Partial, the planner prices the all-reduce that makes it whole before the
normalization reads it, and codegen emits it. Forward takes two all-reduces of one value per channel: the mean,
then the sum of squared deviations from it (a two-pass variance; one collective of sums and sums of squares
would cancel catastrophically where the mean is large against the spread, and SyncBatchNorm's stable single
collective gathers each rank's mean and variance and merges them, a combination no sum expresses). Backward
takes two more: the sums of grad_output and of grad_output times the normalized input. The running statistics
come from the global mean and variance, so they stay exact under any layout. Channel-sharded and replicated
layouts stay legal: every op here shards channels. The price is kernels: about ten elementwise passes instead
of one fused one (the cost model counts them), which only a batch-sharded layout repays.
"""
from __future__ import annotations

import torch

aten = torch.ops.aten


def _acc(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _channel(v: torch.Tensor, ndim: int) -> torch.Tensor:
    return v.reshape([1, -1] + [1] * (ndim - 2))


def batch_norm_training(x, weight, bias, running_mean, running_var, momentum: float, eps: float):
    """(out, save_mean, save_rstd, new running_mean, new running_var) of batch norm in training mode; running
    statistics may be None (track_running_stats=False)."""
    dims = [0, *range(2, x.ndim)]
    count = x.numel() // x.shape[1]
    acc = _acc(x)
    mean = torch.sum(acc, dims) / count
    centred = acc - _channel(mean, x.ndim)
    var = torch.sum(centred * centred, dims) / count
    rstd = torch.rsqrt(var + eps)
    out = centred * _channel(rstd, x.ndim)
    if weight is not None:
        out = out * _channel(weight, x.ndim)
    if bias is not None:
        out = out + _channel(bias, x.ndim)
    new_mean = new_var = None
    if running_mean is not None:
        new_mean = (momentum * mean + (1 - momentum) * running_mean).to(running_mean.dtype)
    if running_var is not None:
        new_var = (momentum * var * (count / (count - 1)) + (1 - momentum) * running_var).to(running_var.dtype)
    return out.to(x.dtype), mean, rstd, new_mean, new_var


def batch_norm_backward(grad_out, x, weight, save_mean, save_rstd, output_mask):
    """(grad_input, grad_weight, grad_bias) of training batch norm, None where `output_mask` says so."""
    dims = [0, *range(2, x.ndim)]
    count = x.numel() // x.shape[1]
    g = _acc(grad_out)
    rstd = _channel(_acc(save_rstd), x.ndim)
    xhat = (_acc(x) - _channel(_acc(save_mean), x.ndim)) * rstd
    sum_g, sum_gx = torch.sum(g, dims), torch.sum(g * xhat, dims)
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        scale = rstd if weight is None else rstd * _channel(_acc(weight), x.ndim)
        centred = g - _channel(sum_g / count, x.ndim) - xhat * _channel(sum_gx / count, x.ndim)
        grad_input = (centred * scale).to(x.dtype)
    if output_mask[1] and weight is not None:
        grad_weight = sum_gx.to(weight.dtype)
    if output_mask[2] and weight is not None:
        grad_bias = sum_g.to(weight.dtype)
    return grad_input, grad_weight, grad_bias


def _functional(x, weight, bias, running_mean, running_var, training, momentum, eps):
    if not training:
        return NotImplemented
    return batch_norm_training(x, weight, bias, running_mean, running_var, momentum, eps)


def _no_stats(x, weight, bias, training, momentum, eps):
    if not training:
        return NotImplemented
    return batch_norm_training(x, weight, bias, None, None, momentum, eps)[:3]


def _backward(grad_out, x, weight, running_mean, running_var, save_mean, save_invstd, train, eps, output_mask):
    if not train:  # eval mode normalizes with running statistics: the fused kernel shards any dim already
        return NotImplemented
    return batch_norm_backward(grad_out, x, weight, save_mean, save_invstd, output_mask)


# op -> decomposition, in the form torch's tracers take (`decompositions=` of aot export and make_fx).
DECOMPOSITIONS = {
    aten._native_batch_norm_legit_functional.default: _functional,
    aten._native_batch_norm_legit.no_stats: _no_stats,
    aten.native_batch_norm_backward.default: _backward,
}

__all__ = ["DECOMPOSITIONS", "batch_norm_training", "batch_norm_backward"]
