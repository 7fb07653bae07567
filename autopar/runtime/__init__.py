"""Execution: ParallelModule (DTensor parameters, the generated per-rank program as an autograd.Function)
and parallelize(), which plans, agrees on the plan across ranks, generates code and loads the weights."""
from autopar.runtime.module import ParallelModule, input_dtensor
from autopar.runtime.parallelize import check_plan, parallelize, rank_spec

__all__ = ["ParallelModule", "parallelize", "rank_spec", "check_plan", "input_dtensor"]
