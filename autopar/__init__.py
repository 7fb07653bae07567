"""autopar: automatic parallelization of PyTorch training, per-op placements chosen by an integer program."""
from autopar.api import plan
from autopar.config import Config, SolverConfig
from autopar.errors import AutoparError, CaptureError, InfeasibleMemoryError, NoStrategyError, PlanMismatchError
from autopar.mesh import fake_mesh
from autopar.plan import Plan

__all__ = ["plan", "parallelize", "Config", "SolverConfig", "Plan", "fake_mesh", "AutoparError", "CaptureError",
           "InfeasibleMemoryError", "NoStrategyError", "PlanMismatchError"]


def __getattr__(name):
    # Execution pulls in torch.distributed runtime pieces; import them on first use.
    if name == "parallelize":
        from autopar.runtime import parallelize

        return parallelize
    if name == "ParallelModule":
        from autopar.runtime import ParallelModule

        return ParallelModule
    raise AttributeError(name)
