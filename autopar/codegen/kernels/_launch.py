"""Shared launch plumbing of the FP8 cast ops: when Triton runs, and the per-format kernel constants."""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
from typing import Iterator

import torch

from autopar.fp8.formats import MANTISSA_BITS, MAX, MIN_NORMAL_EXP, EPS

_MODULE = "autopar.codegen.kernels._triton_fp8"


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_triton(x: torch.Tensor) -> bool:
    """The ops run their Triton kernels on CUDA tensors when Triton is installed, the torch reference elsewhere."""
    return x.is_cuda and triton_available()


@contextlib.contextmanager
def triton_module(interpret: bool = False) -> Iterator:
    """The module of Triton kernels, jitted for the GPU or (interpret=True) for Triton's interpreter, which runs
    them on CPU tensors. Triton reads TRITON_INTERPRET when a kernel is decorated (so switching reloads the
    module) and again in modules it imports lazily during a launch, so the variable stays set inside the block.
    The interpreter also needs Triton's own library imported under TRITON_INTERPRET=1 (tl.max is itself a
    jitted function): in a process that imported Triton without it, interpret=True raises."""
    import sys

    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        if interpret and "triton.language" in sys.modules:
            import triton.language as tl

            if type(tl.standard.max).__name__ == "JITFunction":
                raise RuntimeError("Triton was imported without TRITON_INTERPRET=1, so its own library functions "
                                   "(tl.max, ...) cannot run in the interpreter; set TRITON_INTERPRET=1 before "
                                   "Triton is first imported (python -m autopar.codegen.kernels.selfcheck does)")
        mod = sys.modules.get(_MODULE)
        if mod is None:
            mod = importlib.import_module(_MODULE)
        elif mod.INTERPRETED != interpret:
            mod = importlib.reload(mod)
        yield mod
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved


def format_args(fmt: str) -> dict:
    """The constexpr arguments the kernels take for one FP8 format."""
    import triton.language as tl

    return {"FP8": tl.float8e4nv if fmt == "e4m3" else tl.float8e5, "MANT": MANTISSA_BITS[fmt],
            "MIN_EXP": MIN_NORMAL_EXP[fmt], "FMAX": MAX[fmt], "EPS": EPS}



__all__ = ["triton_available", "use_triton", "triton_module", "format_args"]
