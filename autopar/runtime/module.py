"""ParallelModule: DTensor parameters and the generated per-rank program run as one autograd.Function."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement

from autopar import _torch_compat as compat
from autopar.codegen import LocalProgram
from autopar.codegen.rng import step_seed
from autopar.layout import fmt_layout
from autopar.plan import Plan
from autopar.runtime.state import as_dtensor, local_shard, mesh_coords, mesh_device

if TYPE_CHECKING:
    from autopar.runtime.evaluate import EvalProgram, Evaluator


class _Runner:
    """Calls the generated forward and backward graphs with autocast off: the program already holds the casts
    its plan priced (Config.mixed_precision), and a caller's autocast region must not recast it.

    With `compile`, the graphs run compiled by torch.compile (inductor: Triton kernels on GPU, C++ on CPU),
    each on its first call, from their functional form (LocalProgram.functional)."""

    def __init__(self, program: LocalProgram, device_type: str, compile: bool = False):
        if compile:
            program = program.functional()
            self._graphs = tuple(torch.compile(g, dynamic=False, fullgraph=True)
                                 for g in (program.forward, program.backward))
        else:
            self._graphs = program.forward, program.backward
        self.seed_as_tensor = program.seed_as_tensor
        self._device_type = device_type

    def forward(self, *args: torch.Tensor):
        with torch.autocast(self._device_type, enabled=False):
            return self._graphs[0](*args)

    def backward(self, *args: torch.Tensor):
        with torch.autocast(self._device_type, enabled=False):
            return self._graphs[1](*args)


class _TrainStep(torch.autograd.Function):
    """Forward: the local forward graph over (param shards, buffers, input shards) -> replicated loss.
    Backward: the local backward graph with the incoming loss gradient as its tangent -> param shard grads."""

    # Parameters come in as the DTensors themselves (not `to_local()` views, whose autograd nodes cost more
    # than a small layer's compute) and their gradients go back as DTensors of the same spec.

    @staticmethod
    def forward(ctx, runner: _Runner, n_params: int, *flat: torch.Tensor) -> torch.Tensor:
        params = flat[:n_params]
        out = runner.forward(*[compat.dtensor_local(p) for p in params], *flat[n_params:])
        loss, saved = out[0], out[1:]
        ctx.runner = runner
        ctx.params = params
        ctx.n_rest = len(flat) - n_params
        ctx.save_for_backward(*saved)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grads = ctx.runner.backward(*ctx.saved_tensors, grad_loss.contiguous())
        grads = [None if g is None else compat.dtensor_like(g, p) for g, p in zip(grads, ctx.params)]
        return (None, None, *grads, *([None] * ctx.n_rest))


class ParallelModule(nn.Module):
    """A model parallelized by a Plan. Parameters are DTensors on the mesh (placements in mesh_dim_names
    order) registered under the model's FQNs; calling the module runs one forward pass and returns the
    replicated scalar loss, whose backward fills every parameter's `.grad` as a DTensor of the same placements.

    `pm(*inputs, **kwargs)` takes the GLOBAL batch (every rank passes the same tensors) and keeps this
    rank's shard, or DTensors already laid out as `pm.input_placements` says. What a call runs:

    - train mode, grad enabled: the training program (forward now, backward on `loss.backward()`);
    - train mode under `torch.no_grad()`: the training forward, its tensors for backward dropped at once
      (train-mode semantics, dropout on; the planned input shapes only);
    - eval mode (`pm.eval()`), grad enabled or not: the model's eval-mode loss from a forward-only program
      (see autopar.runtime.evaluate), for inputs of any shape; the loss never requires grad (`pm.train()` to
      train). Each new input signature is captured and planned on its first call, on every rank.

    The module keeps a reference to the model `parallelize` was given, whose structure those eval captures
    trace (its weights are never read).
    """

    def __init__(self, *, plan: Plan, program: LocalProgram, mesh: DeviceMesh, params: dict[str, DTensor],
                 buffers: dict[str, DTensor], aliases: dict[str, list[str]], non_persistent: set[str],
                 input_specs: list[tuple[tuple[int, ...], torch.dtype]], input_layouts: list[tuple],
                 input_leaves: list[int], requires_grad: dict[str, bool], evaluator: Evaluator,
                 rng_seed: int = 0, compile: bool = False):
        super().__init__()
        self.plan = plan
        self.program = program
        self.mesh = mesh
        self._evaluator = evaluator
        self._param_order = list(program.params)
        self._buffer_order = list(program.buffers)
        self._input_specs = input_specs
        self._input_layouts = input_layouts
        self._input_leaves = input_leaves
        self._coords = mesh_coords(mesh)
        self._sizes = tuple(mesh.mesh.shape)
        self._device = mesh_device(mesh)
        self.manual_seed(rng_seed)
        program.forward.to(self._device)  # constants the program holds
        program.backward.to(self._device)
        self._runner = _Runner(program, mesh.device_type, compile)
        for fqn in self._param_order:
            p = nn.Parameter(params[fqn], requires_grad=requires_grad.get(fqn, True))
            for name in [fqn, *aliases.get(fqn, [])]:
                _container(self, name).register_parameter(name.rpartition(".")[2], p)
        for fqn in self._buffer_order:
            _container(self, fqn).register_buffer(fqn.rpartition(".")[2], buffers[fqn],
                                                  persistent=fqn not in non_persistent)

    # --- running -------------------------------------------------------------------------------------------
    @property
    def input_placements(self) -> list[tuple[Placement, ...]]:
        """Per tensor input (flattened args then kwargs), its placements in mesh_dim_names order."""
        return list(self._input_layouts)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not self.training:
            return self._evaluate(args, kwargs)
        inputs = self._local_inputs(args, kwargs)
        params = [self.get_parameter(f) for f in self._param_order]
        buffers = [_local(self.get_buffer(f)) for f in self._buffer_order]
        seed = self._next_seed(self.program, self._runner.seed_as_tensor)
        if not torch.is_grad_enabled():
            return self._runner.forward(*[compat.dtensor_local(p) for p in params], *buffers, *inputs, *seed)[0]
        return _TrainStep.apply(self._runner, len(params), *params, *buffers, *inputs, *seed)

    def manual_seed(self, seed: int, step: int = 0) -> None:
        """Restart the random stream dropout masks are drawn from at `seed`, as if the program had run `step`
        times since (to resume a run: its seed and its number of training forward calls). Call it on every
        rank with the same values; see autopar/codegen/rng.py for what the masks depend on."""
        self._rng_base, self._rng_step = int(seed), int(step)

    def _next_seed(self, program: LocalProgram, as_tensor: bool = False) -> list:
        """The step seed a program that draws dropout masks takes as its last input (an int, or a 0-d int64
        tensor for a compiled program); one per call."""
        if not program.takes_seed:
            return []
        self._rng_step += 1
        seed = step_seed(self._rng_base, self._rng_step - 1)
        return [torch.tensor(seed, dtype=torch.int64) if as_tensor else seed]

    def eval_program(self, *args: Any, **kwargs: Any) -> EvalProgram:
        """The forward-only program (`.program`) and its plan (`.plan`) that eval-mode calls with inputs like
        these run; captured and planned on first use, so call it on every rank."""
        return self._evaluator.program(args, kwargs)

    def _evaluate(self, args: tuple, kwargs: dict) -> torch.Tensor:
        entry = self._evaluator.program(args, kwargs)
        leaves = compat.tree_leaves((args, kwargs))
        inputs = [self._eval_input(leaves[i], lay) for i, lay in zip(entry.input_leaves, entry.input_layouts)]
        params = [compat.dtensor_local(self.get_parameter(f)) for f in entry.program.params]
        buffers = [_local(self.get_buffer(f)) for f in entry.program.buffers]
        with torch.no_grad(), torch.autocast(self.mesh.device_type, enabled=False):
            return entry.program.forward(*params, *buffers, *inputs, *self._next_seed(entry.program))[0]

    def _eval_input(self, x: torch.Tensor, layout: tuple) -> torch.Tensor:
        """This rank's shard of an eval input; a DTensor in another layout is gathered first."""
        if isinstance(x, DTensor):
            if tuple(x.placements) == layout:
                return x.to_local()
            x = x.full_tensor()
        return local_shard(x, layout, self._coords, self._sizes).to(self._device).contiguous()

    def step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Forward and backward (grads accumulate into `.grad`); returns the detached loss."""
        loss = self(*args, **kwargs)
        loss.backward()
        return loss.detach()

    def _local_inputs(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        leaves = compat.tree_leaves((args, kwargs))
        out = []
        for i, (leaf_idx, (shape, dtype), layout) in enumerate(zip(self._input_leaves, self._input_specs,
                                                                   self._input_layouts)):
            if leaf_idx >= len(leaves):
                raise ValueError(f"the model was planned with at least {leaf_idx + 1} inputs (args then kwargs), "
                                 f"got {len(leaves)}")
            x = leaves[leaf_idx]
            if isinstance(x, DTensor):
                if tuple(x.placements) != tuple(layout) or tuple(x.shape) != tuple(shape):
                    raise ValueError(f"input {i} is a DTensor of shape {list(x.shape)} with placements "
                                     f"{fmt_layout(x.placements)}; the plan expects shape {list(shape)} laid out as "
                                     f"{fmt_layout(layout)} (see pm.input_placements)")
                out.append(x.to_local())
                continue
            if not isinstance(x, torch.Tensor):
                raise ValueError(f"input {i} must be a tensor, got {type(x).__name__}")
            if tuple(x.shape) != tuple(shape):
                raise ValueError(f"input {i} has shape {list(x.shape)} but the plan was made for {list(shape)}; "
                                 "pass the same global shapes as the example inputs (every rank the full batch), "
                                 "or re-plan for the new shapes (in eval mode, pm.eval(), any shape runs)")
            if x.dtype != dtype:
                raise ValueError(f"input {i} has dtype {x.dtype}, the plan was made for {dtype}")
            x = local_shard(x, layout, self._coords, self._sizes)
            out.append(x.to(self._device).contiguous())
        return out

    # --- inspection and state ------------------------------------------------------------------------------
    def local_code(self) -> str:
        """This rank's generated forward and backward programs as Python text."""
        return self.program.code()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every persistent parameter and buffer as a full (unsharded) tensor; collective over the mesh."""
        return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach()
                for k, v in self.state_dict(keep_vars=True).items()}

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy full tensors in, keeping only this rank's shards. Strict: keys must match `state_dict()`."""
        own = self.state_dict(keep_vars=True)
        missing = sorted(set(own) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(own))
        if missing or unexpected:
            raise ValueError(f"load_full_state_dict: missing keys {missing[:5]}, unexpected keys {unexpected[:5]}")
        with torch.no_grad():
            for k, v in own.items():
                full = state_dict[k]
                full = full.full_tensor() if isinstance(full, DTensor) else full
                if tuple(full.shape) != tuple(v.shape):
                    raise ValueError(f"load_full_state_dict: {k} has shape {list(full.shape)}, the model has "
                                     f"{list(v.shape)}")
                if isinstance(v, DTensor):
                    v.to_local().copy_(local_shard(full, v.placements, self._coords, self._sizes))
                else:
                    v.copy_(full)

    def extra_repr(self) -> str:
        mesh = dict(zip(self.plan.mesh.axis_names, self.plan.mesh.shape))
        return f"mesh={mesh}, params={len(self._param_order)}"


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _container(root: nn.Module, fqn: str) -> nn.Module:
    """The submodule that holds `fqn`'s last segment, creating empty containers along the path."""
    mod = root
    for part in fqn.split(".")[:-1]:
        child = mod._modules.get(part)
        if child is None:
            if hasattr(mod, part):
                raise ValueError(f"parameter {fqn}: the module name {part!r} clashes with an attribute of "
                                 f"{type(mod).__name__}; rename the submodule")
            child = nn.Module()
            mod.add_module(part, child)
        mod = child
    return mod


def input_dtensor(x: torch.Tensor, mesh: DeviceMesh, layout: Sequence[Placement]) -> DTensor:
    """A global input tensor (the same on every rank) as a DTensor laid out as `layout`."""
    local = local_shard(x, layout, mesh_coords(mesh), tuple(mesh.mesh.shape)).contiguous()
    return as_dtensor(local.to(mesh_device(mesh)), mesh, tuple(layout), x.shape)
