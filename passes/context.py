"""State shared by the passes of one compilation."""
from __future__ import annotations

import dataclasses
from typing import Any

import torch.fx as fx

from autopar.capture import Captured
from autopar.config import Config
from autopar.mesh import MeshSpec
from autopar.strategy import NodeStrategy


@dataclasses.dataclass
class Edge:
    """Producer output `out` of variable `src` feeds tensor input `arg` of variable `dst`, `count` times."""

    src: str
    out: int
    dst: str
    arg: int
    count: float
    kind: str  # activation | param | grad | buffer (a mutated buffer's new value) | loss
    meta: Any = None  # TensorMeta of the value on the edge


@dataclasses.dataclass
class PassContext:
    captured: Captured
    mesh: MeshSpec
    config: Config
    hw: Any
    precision: Any
    memory_limit: int
    progress: Any = None
    deadline: float | None = None  # time.monotonic() by which planning ends (Config.solver_time_limit_s)
    min_inner: int = 1
    # Microbatches per step: the graph is one microbatch's; compute and activation collectives run this many
    # times per step, gradient collectives and the optimizer once (Config.microbatches).
    microbatches: int = 1
    # The mesh axis that splits the model into pipeline stages (autopar.mesh.PIPELINE_AXIS_NAMES), or None; and
    # what passes/split_stages.py derives: node sides and stage memory before the solve, cuts and schedule after.
    pipeline_axis: int | None = None
    pipeline: Any = None
    # annotate_shapes
    key: dict[fx.Node, str] = dataclasses.field(default_factory=dict)
    members: dict[str, list[fx.Node]] = dataclasses.field(default_factory=dict)
    node_count: dict[str, float] = dataclasses.field(default_factory=dict)
    saved: set[str] = dataclasses.field(default_factory=set)
    param_derived: set[fx.Node] = dataclasses.field(default_factory=set)
    # forward nodes backward recomputes (autopar/recompute.py; passes/recompute_variants.py): per layer stack its
    # variant, who chose it, the stacks the solver decides, and the variants fixed before the solve
    recomputed: set[fx.Node] = dataclasses.field(default_factory=set)
    recompute: dict[str, str] = dataclasses.field(default_factory=dict)
    recompute_by: dict[str, str] = dataclasses.field(default_factory=dict)
    recompute_offered: list[str] = dataclasses.field(default_factory=list)
    recompute_fixed: dict[str, str] = dataclasses.field(default_factory=dict)
    # The decided stacks as one program's selectors (recompute_variants.joint): None until built, False where
    # the solve branches over combinations instead.
    recompute_joint: Any = None
    edges: list[Edge] = dataclasses.field(default_factory=list)
    # enumerate_strategies
    strategies: dict[str, list[NodeStrategy]] = dataclasses.field(default_factory=dict)
    unknown_ops: set[str] = dataclasses.field(default_factory=set)
    # plan key -> autopar.fp8.sites.GemmSite: the matmuls that may run in FP8 (passes/fp8_variants.py)
    fp8_sites: dict[str, Any] = dataclasses.field(default_factory=dict)
    # merge_followers: key -> (root key, root strategy index -> this key's strategy index)
    follow: dict[str, tuple[str, list[int]]] = dataclasses.field(default_factory=dict)
    # estimate_costs
    compute_cost: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    edge_cost: list[Any] = dataclasses.field(default_factory=list)
    edge_groups: list[int | None] = dataclasses.field(default_factory=list)  # shared redistributions
    memory_cost: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    # Layouts and (shape, dtype, bucketed) kinds numbered once, and transition seconds memoized by those numbers
    # (estimate_costs._cost_matrix).
    layout_ids: dict[tuple, int] = dataclasses.field(default_factory=dict)
    transition_kinds: dict[tuple, int] = dataclasses.field(default_factory=dict)
    transition_memo: dict[tuple[int, int, int], float] = dataclasses.field(default_factory=dict)
    memory_profile: Any = None  # memory_profile.MemoryProfile, built on first use
    copy_bytes: Any = None  # memory_profile: per edge, its copy's bytes per layout pair, built on first use
    # solve_placements: {(microbatches, no pipeline, bound): the gradient buckets as the program's buffers}, built once
    grad_buffers: Any = None
    # solve_placements
    choice: dict[str, int] = dataclasses.field(default_factory=dict)
    solver_stats: dict[str, Any] = dataclasses.field(default_factory=dict)
    # simulate_step
    simulation: Any = None
    plan: Any = None
    timings: dict[str, float] = dataclasses.field(default_factory=dict)

    def chosen(self, key: str) -> NodeStrategy:
        return self.strategies[key][self.choice[key]]
