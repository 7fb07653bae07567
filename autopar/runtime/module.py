"""ParallelModule: DTensor parameters and the generated per-rank program run as one autograd.Function."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement

from autopar import _torch_compat as compat
from autopar.codegen import functional
from autopar.codegen.rng import step_seed
from autopar.layout import fmt_layout
from autopar.program import Program
from autopar.runtime.fp8 import NonFiniteCheck
from autopar.runtime.state import as_dtensor, local_shard, mesh_coords, mesh_device


class _Runner:
    """Calls the generated forward and backward graphs with autocast off: the program already holds the casts
    its plan priced (Config.mixed_precision), and a caller's autocast region must not recast it.

    With `compile`, the graphs run compiled by torch.compile (inductor: Triton kernels on GPU, C++ on CPU),
    each on its first call, from their functional form (autopar.codegen.functional)."""

    def __init__(self, program: Program, device_type: str, compile: bool = False):
        graphs = (program.forward, program.backward, program.grad_sync)
        if compile:
            program = functional(program)
            graphs = (program.forward, program.backward, program.grad_sync)
            graphs = tuple(g if g is None else torch.compile(g, dynamic=False, fullgraph=True) for g in graphs)
        self._graphs = graphs
        self.program = program
        self.seed_as_tensor = program.seed_as_tensor
        self._device_type = device_type
        self.nonfinite = NonFiniteCheck.of(program)
        # Buffers the step updates (batch norm statistics): their positions among the forward's inputs.
        n = len(program.params)
        self._updated = [n + program.buffer_names.index(f) for f in program.buffer_updates]
        self._heads = max(1, len(program.activations_out))

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, tuple, torch.Tensor | None, tuple]:
        """Runs the forward graph, writes the buffers' new values into them (in place, as the one-device
        module does), and returns the loss (a program that hands values on instead, `activations_out`: a tuple of
        them), the other outputs (local pieces), the loss's count (programs of several microbatches whose loss is
        a ratio; else None) and the tensors saved for backward."""
        with torch.autocast(self._device_type, enabled=False):
            out = self._graphs[0](*args)
        h, k, m = self._heads, len(self._updated), len(self.program.outputs)
        c = int(self.program.returns_count)
        with torch.no_grad():
            for i, new in zip(self._updated, out[h:h + k]):
                args[i].copy_(new)
        count = out[h + k + m] if c else None
        heads = tuple(out[:h]) if self.program.activations_out else out[0]
        return heads, tuple(out[h + k:h + k + m]), count, out[h + k + m + c:]

    def backward(self, *args: torch.Tensor):
        with torch.autocast(self._device_type, enabled=False):
            return self._graphs[1](*args)

    def grad_sync(self, *grads: torch.Tensor):
        """The gradient collectives of a step of several microbatches (Program.grad_sync)."""
        with torch.autocast(self._device_type, enabled=False):
            return self._graphs[2](*grads)


class _TrainStep(torch.autograd.Function):
    """Forward: the local forward graph over (param shards, buffers, input shards) -> replicated loss.
    Backward: the local backward graph with the incoming loss gradient as its tangent -> param shard grads."""

    # Parameters come in as the DTensors themselves (not `to_local()` views, whose autograd nodes cost more
    # than a small layer's compute) and their gradients go back as DTensors of the same spec.

    @staticmethod
    def forward(ctx, runner: _Runner, n_params: int, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        params = flat[:n_params]
        loss, outputs, _, saved = runner.forward(*[compat.dtensor_local(p) for p in params], *flat[n_params:])
        ctx.runner = runner
        ctx.params = params
        ctx.n_rest = len(flat) - n_params
        ctx.save_for_backward(*saved)
        ctx.mark_non_differentiable(*outputs)
        return (loss, *outputs)

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, *_outputs):
        grads = ctx.runner.backward(*ctx.saved_tensors, grad_loss.contiguous())
        if ctx.runner.nonfinite is not None:
            grads = ctx.runner.nonfinite.check(grads)
        grads = [None if g is None else compat.dtensor_like(g, p) for g, p in zip(grads, ctx.params)]
        return (None, None, *grads, *([None] * ctx.n_rest))


@dataclasses.dataclass
class Built:
    """A training program for a ParallelModule: the Program, the parameters and buffers as DTensors in its
    layouts, and the callables that build the module's further programs (eval inputs, another rank's)."""

    program: Program
    params: dict[str, DTensor]
    buffers: dict[str, DTensor]
    build_eval_program: Callable[[tuple, dict], Program]
    program_of_rank: Callable[[int], Program] | None = None
    # A pipelined plan: the Programs of the stages this rank runs (`program` is the first of them).
    stages: list[Program] | None = None


class ParallelModule(nn.Module):
    """A model parallelized by a Plan. Parameters are DTensors on the mesh (placements in mesh_dim_names
    order) registered under the model's FQNs; calling the module runs one forward pass and returns the
    replicated scalar loss, whose backward fills every parameter's `.grad` as a DTensor of the same placements.

    `pm(*inputs, **kwargs)` takes the GLOBAL batch (every rank passes the same tensors) and keeps this
    rank's shard, or DTensors already laid out as `pm.input_placements` says. What a call runs:

    - train mode, grad enabled: the training program (forward now, backward on `loss.backward()`);
    - train mode under `torch.no_grad()`: the training forward, its tensors for backward dropped at once
      (train-mode semantics, dropout on; the planned input shapes only);
    - eval mode (`pm.eval()`), grad enabled or not: the model's eval-mode loss from a forward-only program,
      for inputs of any shape; the loss never requires grad (`pm.train()` to train). Each new input signature
      gets its program from `build_eval_program(args, kwargs)` on its first call, on every rank.

    Built by `autopar.parallelize`, which hands it either a `Built` training program or a `build(args, kwargs)`
    callable that makes one from the first call's inputs (every rank makes that call); a Built carries the
    callables that make further programs (`build_eval_program`, `program_of_rank`). The module never captures
    or plans itself. Its parameters are registered at construction and keep their identity: when the program
    arrives, each one takes the plan's placements in place (`torch.utils.swap_tensors`), so an optimizer made
    before the first call steps the sharded parameters.
    """

    def __init__(self, *, mesh: DeviceMesh, params: dict[str, torch.Tensor], buffers: dict[str, DTensor],
                 aliases: dict[str, list[str]], non_persistent: set[str], requires_grad: dict[str, bool],
                 built: Built | None = None, build: Callable[[tuple, dict], Built] | None = None, rng_seed: int = 0,
                 compile: bool = False):
        super().__init__()
        self.plan = None
        self.mesh = mesh
        self._program: Program | None = None
        self._build = build
        self._compile = compile
        self._eval: dict[tuple, _Runner] = {}  # input signature -> the runner of its eval program
        self._coords = mesh_coords(mesh)
        self._sizes = tuple(mesh.mesh.shape)
        self._device = mesh_device(mesh)
        self._non_persistent = non_persistent
        self.manual_seed(rng_seed)
        for fqn, t in params.items():
            p = t if isinstance(t, nn.Parameter) else nn.Parameter(t, requires_grad=requires_grad.get(fqn, True))
            for name in [fqn, *aliases.get(fqn, [])]:
                _container(self, name).register_parameter(name.rpartition(".")[2], p)
        for fqn, b in buffers.items():
            _container(self, fqn).register_buffer(fqn.rpartition(".")[2], b, persistent=fqn not in non_persistent)
        if built is not None:
            self._install(built, params_registered=True)

    def _install(self, built: Built, params_registered: bool = False) -> None:
        """Take a training program: its parameters' placements into the registered Parameter objects (unless
        they were registered from `built` itself), its buffers, its runner."""
        program = built.program
        for fqn in [] if params_registered else program.param_names:
            p = self.get_parameter(fqn)
            torch.utils.swap_tensors(p, nn.Parameter(built.params[fqn], requires_grad=p.requires_grad))
        for fqn in program.buffer_names:
            _container(self, fqn).register_buffer(fqn.rpartition(".")[2], built.buffers[fqn],
                                                  persistent=fqn not in self._non_persistent)
        program.forward.to(self._device)  # constants the program holds
        program.backward.to(self._device)
        self._program, self.plan = program, program.plan
        self._runner = _Runner(program, self.mesh.device_type, self._compile)
        self._pipeline = None
        if self._compile and program.microbatches > 1:
            raise ValueError(f"parallelize(compile=True) does not compile plans of several microbatches or pipeline "
                             f"stages yet (this plan has {program.microbatches} microbatches): pass compile=False, or "
                             "plan with Config(microbatches=1) on a mesh without a pipeline axis")
        if built.stages:
            from autopar.runtime.pipeline import PipelineRunner

            for prog in built.stages:
                prog.forward.to(self._device)
                prog.backward.to(self._device)
            self._pipeline = PipelineRunner(built.stages, self.mesh, self._device)
        self._build_eval_program, self._program_of_rank = built.build_eval_program, built.program_of_rank
        self._build = None

    def _planned(self, args: tuple, kwargs: dict) -> Program:
        """The training program, built from these inputs on the first call when none was given."""
        if self._program is None:
            if self._build is None:
                raise ValueError("this ParallelModule has no program and no way to build one")
            self._install(self._build(args, kwargs))
        return self._program

    # --- running -------------------------------------------------------------------------------------------
    @property
    def input_placements(self) -> list[tuple[Placement, ...]]:
        """Per tensor input (flattened args then kwargs), its placements in mesh_dim_names order."""
        return [tuple(i.layout) for i in self._require_program().inputs]

    def _require_program(self) -> Program:
        if self._program is None:
            raise ValueError("the ParallelModule plans on its first call: call it once with a batch (on every "
                             "rank), or pass example_inputs to autopar.parallelize to plan ahead")
        return self._program

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        prog = self._planned(args, kwargs)
        if not self.training:
            if prog.stage is not None:
                raise ValueError("eval mode of a pipelined plan is not supported yet: each rank holds only its "
                                 "stages' parameters; evaluate with pm.train() and torch.no_grad() unavailable "
                                 "too, so plan an eval model without a pipeline axis")
            return self._evaluate(args, kwargs)
        if prog.stage is not None:
            raise ValueError(f"the plan runs {prog.plan.pipeline.stages} pipeline stages "
                             f"({prog.plan.pipeline.schedule}, {prog.microbatches} microbatches): train with "
                             "`loss = pm.step(*inputs, **kwargs)`, which runs the schedule over every microbatch and "
                             "returns the batch's loss on every rank")
        if prog.microbatches > 1:
            raise ValueError(f"the plan splits each batch into {prog.microbatches} microbatches "
                             f"(plan.microbatches): train with `loss = pm.step(*inputs, **kwargs)`, which runs "
                             "the forward and backward of every microbatch, reduces the gradients once and returns "
                             "the batch's loss; `loss = pm(...); loss.backward()` needs a plan of one microbatch "
                             "(Config(microbatches=1)). Eval mode (pm.eval()) runs pm(...) as usual")
        inputs = self._local_inputs(args, kwargs)
        params = [self.get_parameter(f) for f in prog.param_names]
        buffers = [_local(self.get_buffer(f)) for f in prog.buffer_names]
        seed = self._next_seed(prog, self._runner.seed_as_tensor)
        if not torch.is_grad_enabled():
            loss, outputs, _, _ = self._runner.forward(*[compat.dtensor_local(p) for p in params], *buffers, *inputs,
                                                    *seed)
        else:
            loss, *outputs = _TrainStep.apply(self._runner, len(params), *params, *buffers, *inputs, *seed)
        return self._result(prog, loss, outputs)

    def _result(self, prog: Program, loss: torch.Tensor, outputs) -> Any:
        """The loss, or (loss, *outputs) with each other output a DTensor in its planned layout."""
        if not prog.outputs:
            return loss
        return (loss, *(as_dtensor(o, self.mesh, spec.layout, spec.shape) for o, spec in zip(outputs, prog.outputs)))

    @property
    def fp8_nonfinite(self) -> bool:
        """Whether the last backward of an FP8 program found an inf or nan gradient and zeroed the gradients
        (Fp8Config(on_nonfinite="zero")): skip that optimizer step. `fp8_nonfinite_steps` counts such steps."""
        check = getattr(self, "_runner", None) and self._runner.nonfinite
        return bool(check and check.last)

    @property
    def fp8_nonfinite_steps(self) -> int:
        check = getattr(self, "_runner", None) and self._runner.nonfinite
        return check.steps if check else 0

    def manual_seed(self, seed: int, step: int = 0) -> None:
        """Restart the random stream dropout masks are drawn from at `seed`, as if the program had run `step`
        times since (to resume a run: its seed and its number of training forward calls). Call it on every
        rank with the same values; see autopar/codegen/rng.py for what the masks depend on."""
        self._rng_base, self._rng_step = int(seed), int(step)

    def _next_seed(self, program: Program, as_tensor: bool = False) -> list:
        """The step seed a program that draws dropout masks takes as its last input (an int, or a 0-d int64
        tensor for a compiled program); one per call."""
        if not program.takes_seed:
            return []
        self._rng_step += 1
        seed = step_seed(self._rng_base, self._rng_step - 1)
        return [torch.tensor(seed, dtype=torch.int64) if as_tensor else seed]

    def program(self, rank: int | None = None) -> Program:
        """The training Program of global rank `rank` (print it to read its code, collectives and buckets);
        None: the one this rank runs. Another rank's is generated here with placeholder group names."""
        prog = self._require_program()
        if rank is None or rank == prog.rank.rank:
            return prog
        if self._program_of_rank is None:
            raise ValueError("this ParallelModule was built without a way to generate other ranks' programs")
        return self._program_of_rank(rank)

    def stage_programs(self) -> list[Program]:
        """A pipelined plan's Programs of the stages this rank runs (a plan without a pipeline: its one Program)."""
        prog = self._require_program()
        return list(self._pipeline.programs) if self._pipeline is not None else [prog]

    def eval_program(self, *args: Any, **kwargs: Any) -> Program:
        """The forward-only Program (with its `.plan`) that eval-mode calls with inputs like these run; built
        on first use, so call it on every rank."""
        self._require_program()
        return self._eval_runner(args, kwargs).program

    def _eval_runner(self, args: tuple, kwargs: dict) -> _Runner:
        key = _signature(args, kwargs)
        if key not in self._eval:
            prog = self._build_eval_program(args, kwargs)
            prog.forward.to(self._device)  # constants the program holds
            self._eval[key] = _Runner(prog, self.mesh.device_type)
        return self._eval[key]

    def _evaluate(self, args: tuple, kwargs: dict) -> torch.Tensor:
        runner = self._eval_runner(args, kwargs)
        prog = runner.program
        leaves = compat.tree_leaves((args, kwargs))
        inputs = [self._eval_input(leaves[i.leaf], i.layout) for i in prog.inputs]
        params = [compat.dtensor_local(self.get_parameter(f)) for f in prog.param_names]
        buffers = [_local(self.get_buffer(f)) for f in prog.buffer_names]
        with torch.no_grad():
            loss, outputs, _, _ = runner.forward(*params, *buffers, *inputs, *self._next_seed(prog))
        return self._result(prog, loss, outputs)

    def _eval_input(self, x: torch.Tensor, layout: tuple) -> torch.Tensor:
        """This rank's shard of an eval input; a DTensor in another layout is gathered first."""
        if isinstance(x, DTensor):
            if tuple(x.placements) == layout:
                return x.to_local()
            x = x.full_tensor()
        return local_shard(x, layout, self._coords, self._sizes).to(self._device).contiguous()

    def step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """One training step's forward and backward over the global batch: gradients accumulate into `.grad`
        (as `loss.backward()` does; the optimizer step stays the caller's) and the detached loss of the whole
        batch is returned on every rank. With several microbatches (plan.microbatches) it runs each one's
        forward and backward in turn and reduces the gradients once (autopar/runtime/accumulate.py)."""
        prog = self._planned(args, kwargs)
        if self._pipeline is not None and self.training:
            return self._pipeline.step(self, args, kwargs)
        if prog.microbatches > 1 and self.training:
            from autopar.runtime.accumulate import step_microbatches

            return step_microbatches(self, prog, self._runner, args, kwargs)
        out = self(*args, **kwargs)
        loss = out[0] if isinstance(out, tuple) else out
        loss.backward()
        return loss.detach()

    def _step_seeds(self, program: Program, m: int) -> list[list]:
        """The dropout step seeds of a step's m microbatches (one list per microbatch, empty without dropout)."""
        return [self._next_seed(program) for _ in range(m)]

    def _local_inputs(self, args: tuple, kwargs: dict, program: Program | None = None) -> list[torch.Tensor]:
        leaves = compat.tree_leaves((args, kwargs))
        out = []
        for i, spec in enumerate((program or self._program).inputs):
            leaf_idx, shape, dtype, layout = spec.leaf, spec.shape, spec.dtype, spec.layout
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
        return self._require_program().code()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every persistent parameter and buffer as a full (unsharded) tensor; collective over the mesh."""
        if getattr(self, "_pipeline", None) is not None:
            raise ValueError("full_state_dict of a pipelined plan is not supported yet: each rank holds only its "
                             "stages' parameters (pm.stage_programs() lists them)")
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
        mesh = dict(zip(self.mesh.mesh_dim_names, self.mesh.mesh.shape))
        return f"mesh={mesh}, planned={self._program is not None}"


def _signature(args: tuple, kwargs: dict) -> tuple:
    """What a traced program depends on: the nesting of the inputs, each tensor's global shape and dtype, and
    every other value (baked into the graph)."""
    leaves, spec = compat.tree_flatten((args, kwargs))
    return str(spec), tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else repr(x) for x in leaves)


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
