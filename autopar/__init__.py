"""autopar: automatic parallelization of PyTorch training, per-op placements chosen by an integer program."""
from autopar.api import parallelize, plan, program
from autopar.backend import backend
from autopar.config import Config, SolverConfig
from autopar.errors import AutoparError, CaptureError, InfeasibleMemoryError, NoStrategyError, PlanMismatchError
from autopar.mesh import fake_mesh
from autopar.plan import Plan
from autopar.program import Program

__all__ = ["plan", "parallelize", "program", "backend", "Config", "SolverConfig", "Plan", "Program", "fake_mesh",
           "AutoparError", "CaptureError", "InfeasibleMemoryError", "NoStrategyError", "PlanMismatchError",
           "ParallelModule"]


def __getattr__(name):
    # The runtime pulls in torch.distributed pieces; import it on first use.
    if name == "ParallelModule":
        from autopar.runtime import ParallelModule

        return ParallelModule
    raise AttributeError(name)
