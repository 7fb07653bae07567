"""Execution of generated Programs on torch.distributed: ParallelModule (DTensor parameters, a rank's Program
run as an autograd.Function), the job's mesh and process groups, agreement on one plan across ranks, and
parameter state. Nothing here captures a model or plans: `autopar.parallelize` (autopar/api.py) does, and hands
the runtime Programs and callables that build more."""
from autopar.runtime.dist import agree_on_plan, agree_on_seed, check_mesh, rank_spec, world
from autopar.runtime.module import Built, ParallelModule, input_dtensor
from autopar.runtime.state import load_state, non_persistent_buffers, placeholder_state

__all__ = ["Built", "ParallelModule", "input_dtensor", "placeholder_state", "agree_on_plan", "agree_on_seed", "check_mesh", "rank_spec", "world",
           "load_state", "non_persistent_buffers"]
