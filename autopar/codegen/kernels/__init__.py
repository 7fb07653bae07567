"""autopar's own kernels, each a torch.library custom op in a module of its own, with a fake implementation
(shapes for tracing and codegen) and a sharding rule (autopar/rules/fp8.py):

    autopar::fp8_cast_tensorwise   cast_tensorwise.py   amax + scale + cast, one scale
    autopar::fp8_cast_rowwise      cast_rowwise.py      amax + scale + cast, one scale per row
    autopar::fp8_cast_transpose    cast_transpose.py    the cast of x^T, C-contiguous (either scaling)

On CUDA tensors they run Triton kernels (_triton_fp8.py; Triton is the optional `autopar[triton]` extra, which a
GPU build of torch brings); elsewhere the torch reference (reference.py), which the kernels match bit for bit
(tests/test_kernels.py runs them under Triton's interpreter on CPU).
"""
from autopar.codegen.kernels.cast_rowwise import FP8_CAST_ROWWISE
from autopar.codegen.kernels.cast_tensorwise import FP8_CAST_TENSORWISE
from autopar.codegen.kernels.cast_transpose import FP8_CAST_TRANSPOSE

__all__ = ["FP8_CAST_TENSORWISE", "FP8_CAST_ROWWISE", "FP8_CAST_TRANSPOSE"]


def _register_rules() -> None:
    from autopar.rules.fp8 import register_rules

    register_rules(FP8_CAST_TENSORWISE, FP8_CAST_ROWWISE, FP8_CAST_TRANSPOSE)


_register_rules()
