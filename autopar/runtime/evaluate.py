"""Forward-only programs for evaluation.

A ParallelModule in eval mode runs its source model's eval-mode graph (dropout off), captured without a
backward and planned with every parameter and buffer pinned to the placement training keeps it in, so the eval
program reads the training DTensors as they are. One program per input signature (shapes, dtypes, non-tensor
values), captured and planned on first use: eval batches may have other shapes than training batches.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autopar import _torch_compat as compat
from autopar.codegen import LocalProgram, generate
from autopar.config import Config
from autopar.plan import Plan
from autopar.runtime.parallelize import _agree_on_plan, _reject_collectives, _world, input_layouts, rank_spec
from autopar.runtime.state import mesh_device


@dataclasses.dataclass
class EvalProgram:
    """One forward-only program (params, buffers, inputs -> loss), its plan, and where its inputs come from:
    per tensor input, its index among the call's flattened (args, kwargs) and its layout."""

    program: LocalProgram
    plan: Plan
    input_leaves: list[int]
    input_layouts: list[tuple]


class Evaluator:
    """Builds and caches the eval programs of one ParallelModule.

    Holds the source model (only its module structure is traced; its weights are never read, so it may live
    on the meta device), the loss function, the training config and the placement of every parameter and
    buffer (FQN -> placements), which the eval plans pin."""

    def __init__(self, model: nn.Module, mesh: DeviceMesh, loss_fn: Callable | None, config: Config,
                 placements: dict[str, tuple]):
        self.model = model
        self.mesh = mesh
        self.loss_fn = loss_fn
        self.config = config
        self.placements = placements
        self._programs: dict[tuple, EvalProgram] = {}

    def program(self, args: tuple, kwargs: dict) -> EvalProgram:
        """The eval program for inputs like these; the first call per signature captures and plans (rank 0
        plans and broadcasts), so every rank must make it."""
        key = _signature(args, kwargs)
        if key not in self._programs:
            self._programs[key] = self._build(args, kwargs)
        return self._programs[key]

    def _build(self, args: tuple, kwargs: dict) -> EvalProgram:
        from autopar.api import make_context
        from autopar.passes import annotate_shapes_pass

        # Inputs are planned afresh (eval shapes may differ); activation pins name training-graph nodes.
        config = self.config.with_(pins=self.placements, input_placements=None)
        with _forward_only(self.model):
            ctx = make_context(self.model, self.mesh, args, kwargs, self.loss_fn, config, template_layers=None)
        cap = ctx.captured
        _reject_collectives(cap)
        annotate_shapes_pass(cap.gm, ctx)
        world, rank = _world()
        plan = _agree_on_plan(ctx, None, world, rank)
        program = generate(plan, cap, rank_spec(self.mesh))
        program.forward.to(mesh_device(self.mesh))  # constants the program holds
        leaves, layouts = input_layouts(plan, cap)
        return EvalProgram(program, plan, leaves, layouts)


@contextlib.contextmanager
def _forward_only(model: nn.Module) -> Iterator[None]:
    """The model in eval mode with no parameter requiring grad (so the trace has no backward); every module's
    mode and parameter's requires_grad restored on exit."""
    modes = [(m, m.training) for m in model.modules()]
    requires = [(p, p.requires_grad) for p in model.parameters()]
    model.eval()
    for p, _ in requires:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training
        for p, req in requires:
            p.requires_grad_(req)


def _signature(args: tuple, kwargs: dict) -> tuple:
    """What a traced program depends on: the nesting of the inputs, each tensor's global shape and dtype, and
    every other value (baked into the graph)."""
    leaves, spec = compat.tree_flatten((args, kwargs))
    return str(spec), tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else repr(x) for x in leaves)
