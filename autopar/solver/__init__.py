"""The placement integer program."""
from autopar.solver.ilp import IlpProblem, IlpResult, solve

__all__ = ["IlpProblem", "IlpResult", "solve"]
