"""The op sharding-rule registry: one rule per aten op, giving its legal placements on one mesh axis.

    from autopar.rules import axis_strategies, register, einsum_strategies
    strategies, known = axis_strategies(op_info(node))   # all-replicate first; known=False: no rule for the op

Rules live in one module per op family (matmul, pointwise, views, indexing, reductions, nn, conv, norms,
pooling, attention, factory); importing this package registers them all. Ops without a rule fall back to
DTensor's own one-axis strategy where torch has one, and are listed by `missing_ops()`. `operator.getitem` is the caller's to handle.
"""
from autopar.rules.base import ALL_R, AxisStrategy, OpInfo, Rule, TensorMeta, op_info, strat
from autopar.rules.registry import (all_replicate, axis_strategies, clear_missing, fmt_strategy, get_rule,
                                    missing_ops, register, registered_targets)
from autopar.rules.matmul import einsum_strategies, with_addend
from autopar.rules.shape_args import SHAPE_ARGS, local_call, localize_args
from autopar.rules import (attention, conv, factory, indexing, nn, norms, pointwise, pooling,  # noqa: F401  (registers)
                           reductions, views)
from autopar.rules.pointwise import PARTIAL_RULES
from autopar.rules.views import dim_groups, reshape_map

__all__ = ["ALL_R", "AxisStrategy", "OpInfo", "Rule", "TensorMeta", "op_info", "strat", "register", "get_rule",
           "registered_targets", "axis_strategies", "all_replicate", "missing_ops", "clear_missing", "fmt_strategy",
           "einsum_strategies", "with_addend", "SHAPE_ARGS", "local_call", "localize_args", "PARTIAL_RULES",
           "dim_groups", "reshape_map"]
