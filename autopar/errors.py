"""User-facing errors: each message says what to change."""
from __future__ import annotations

import traceback


class AutoparError(ValueError):
    """Base class of every error autopar raises for bad input."""


class CaptureError(AutoparError):
    """The model could not be traced into a graph."""

    @classmethod
    def from_exception(cls, e: BaseException) -> "CaptureError":
        frames = traceback.extract_tb(e.__traceback__)
        user = [f for f in frames if "/torch/" not in f.filename and "/autopar/" not in f.filename]
        where = f"{user[-1].filename}:{user[-1].lineno} in {user[-1].name}: {user[-1].line}" if user else "unknown"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return cls(f"could not trace the model at {where}\n  {type(e).__name__}: {first}\n"
                   "Make the forward free of data-dependent Python control flow and of in-place ops on inputs, "
                   "or pass a smaller example input to find the failing module.")


class NoStrategyError(AutoparError):
    """No legal placement remains for a node (e.g. the mesh does not divide any dimension)."""


class InfeasibleMemoryError(AutoparError):
    """No plan fits the memory limit."""


class PlanMismatchError(AutoparError):
    """A plan does not belong to this model, mesh or inputs."""


class SolverTimeout(AutoparError):
    """The planning time limit passed before any plan that fits the memory limit was found."""


class Fp8NonFiniteError(AutoparError, FloatingPointError):
    """A training step whose program runs FP8 matmuls produced an inf or nan gradient (Fp8Config.on_nonfinite)."""
