"""The placement integer program."""
from autopar.solver.bounded import Bounded, solve_bounded
from autopar.solver.dispatch import solve
from autopar.solver.ilp import IlpProblem, IlpResult

__all__ = ["Bounded", "IlpProblem", "IlpResult", "solve", "solve_bounded"]
