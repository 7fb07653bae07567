"""Cost model: op compute time, collective time and training memory on a target device."""
from autopar.cost.comm import COLLECTIVES, collective_time
from autopar.cost.compute import VIEW_OPS, compute_time, compute_time_sharded, op_bytes, op_flops
from autopar.cost.hardware import HARDWARE, HardwareSpec, LinkSpec, get_hardware, link_spec, peak_flops_for
from autopar.cost.memory import (CPU_DEFAULT, GPU_DEFAULT, MIXED_PRECISION, TrainingPrecision, compute_copy_bytes,
                                 param_state_bytes, resolve_precision, tensor_bytes)

__all__ = [
    "HardwareSpec", "LinkSpec", "HARDWARE", "get_hardware", "link_spec", "peak_flops_for",
    "VIEW_OPS", "op_flops", "op_bytes", "compute_time", "compute_time_sharded",
    "COLLECTIVES", "collective_time",
    "tensor_bytes", "TrainingPrecision", "GPU_DEFAULT", "CPU_DEFAULT", "param_state_bytes", "compute_copy_bytes",
    "MIXED_PRECISION", "resolve_precision",
]
