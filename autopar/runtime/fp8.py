"""What a training step does when a program with FP8 matmuls produced an inf or nan gradient."""
from __future__ import annotations

from typing import Sequence

import torch

from autopar.program import Program


class NonFiniteCheck:
    """For a program that runs FP8 matmuls: after each backward, whether any rank holds an inf or nan gradient
    (one max all-reduce of a flag over the world), then Fp8Config.on_nonfinite: "raise" (Fp8NonFiniteError) or
    "zero" (every gradient zeroed, `steps` counts it, `last` says so; the optimizer step stays the caller's)."""

    def __init__(self, policy: str):
        self.policy, self.steps, self.last = policy, 0, False

    @classmethod
    def of(cls, program: Program) -> "NonFiniteCheck | None":
        from autopar.config import Fp8Config

        if not any("_scaled_mm" in str(n.target) for g in (program.forward, program.backward) for n in g.graph.nodes):
            return None
        cfg = (program.plan.config or {}).get("fp8") if program.plan is not None else None
        return cls(Fp8Config.from_json(cfg).on_nonfinite if isinstance(cfg, dict) else "raise")

    def check(self, grads: Sequence) -> list:
        local = [g for g in grads if g is not None]
        if not local:
            return list(grads)
        bad = torch.stack([(~torch.isfinite(g)).any() for g in local]).any().to(torch.int32).reshape(1)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
        self.last = bool(bad.item())
        if not self.last:
            return list(grads)
        if self.policy == "raise":
            from autopar.errors import Fp8NonFiniteError

            raise Fp8NonFiniteError("a gradient of this FP8 step is inf or nan (an inf or nan reached an FP8 cast, or "
                                    "a value overflowed); lower the learning rate, keep the module in bf16 with "
                                    "Fp8Config(exclude=...), or pass Fp8Config(on_nonfinite='zero') to zero such "
                                    "steps' gradients and skip them (pm.fp8_nonfinite)")
        self.steps += 1
        return [None if g is None else torch.zeros_like(g) for g in grads]


__all__ = ["NonFiniteCheck"]
