"""Bytes a tensor occupies and the persistent per-parameter bytes of training under a given precision recipe."""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import torch


def tensor_bytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


@dataclasses.dataclass(frozen=True)
class TrainingPrecision:
    """Dtypes of what training keeps per parameter.

    param_dtype: the stored parameters the optimizer steps. compute_dtype: what forward/backward matmuls read.
    grad_dtype: the accumulated gradients. optimizer_state_bytes_per_param: 8 for AdamW's exp_avg and exp_avg_sq
    in fp32. master_weights: keep an extra fp32 copy of parameters stored in a lower precision (parameters already
    in fp32 are their own master copy, so the flag adds nothing then).
    """

    param_dtype: torch.dtype = torch.float32
    compute_dtype: torch.dtype = torch.float32
    grad_dtype: torch.dtype = torch.float32
    optimizer_state_bytes_per_param: int = 8
    master_weights: bool = False

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The dtype capture autocasts to (None: no autocast): the compute dtype when the stored parameters are
        in another one, so the graph carries the casts and every op runs in the dtype the cost model prices."""
        return self.compute_dtype if self.compute_dtype != self.param_dtype else None

    @property
    def name(self) -> str:
        """The Config.mixed_precision value this recipe stands for, as a plan records it."""
        return "bf16" if self.autocast_dtype == torch.bfloat16 else "fp32"


# Mixed precision as FSDP2 / autocast run it: fp32 parameters, grads and AdamW state; bf16 compute copies.
GPU_DEFAULT = TrainingPrecision(param_dtype=torch.float32, compute_dtype=torch.bfloat16, grad_dtype=torch.float32,
                                optimizer_state_bytes_per_param=8, master_weights=True)
# CPUs gain nothing from bf16 matmuls in tests, so everything stays fp32.
CPU_DEFAULT = TrainingPrecision()


MIXED_PRECISION = {"bf16": GPU_DEFAULT, "fp32": CPU_DEFAULT}


def resolve_precision(mixed_precision: str | None, device_type: str) -> TrainingPrecision:
    """The training precision of Config.mixed_precision on a mesh of `device_type`: "bf16" (bf16 compute, fp32
    parameters, gradients and optimizer state), "fp32", or None for bf16 on accelerators and fp32 on CPU.

    The one resolution both capture (which autocasts to `autocast_dtype`) and the cost model read, so a plan
    never prices another precision than the one its program runs."""
    if mixed_precision is None:
        mixed_precision = "fp32" if device_type == "cpu" else "bf16"
    if mixed_precision not in MIXED_PRECISION:
        raise ValueError(f"unknown mixed_precision {mixed_precision!r}: use 'bf16' (bf16 compute, fp32 master "
                         "weights), 'fp32', or None (bf16 on GPU meshes, fp32 on CPU meshes)")
    return MIXED_PRECISION[mixed_precision]


def _master_bytes_per_param(precision: TrainingPrecision) -> int:
    if precision.master_weights and precision.param_dtype != torch.float32:
        return torch.float32.itemsize
    return 0


def param_state_bytes(numel: int, precision: TrainingPrecision, trainable: bool = True) -> int:
    """Persistent bytes for `numel` parameter elements: stored param + grad + optimizer state (+ fp32 master);
    the stored param alone for a frozen one (requires_grad=False: no gradient, no optimizer state)."""
    if not trainable:
        return numel * precision.param_dtype.itemsize
    per_param = (precision.param_dtype.itemsize + precision.grad_dtype.itemsize
                 + precision.optimizer_state_bytes_per_param + _master_bytes_per_param(precision))
    return numel * per_param


def compute_copy_bytes(numel: int, precision: TrainingPrecision) -> int:
    """Bytes of the compute-dtype copy of `numel` parameter elements; none when parameters are used as stored."""
    if precision.compute_dtype == precision.param_dtype:
        return 0
    return numel * precision.compute_dtype.itemsize


__all__ = ["tensor_bytes", "TrainingPrecision", "GPU_DEFAULT", "CPU_DEFAULT", "MIXED_PRECISION",
           "param_state_bytes", "compute_copy_bytes", "resolve_precision"]
