"""The public entry points: plan a model, parallelize it for training, or read the Program a rank would run.

Each composes autopar.compiler (capture -> passes -> Plan -> codegen -> Program) with, for `parallelize`, the
runtime that runs Programs on torch.distributed; the runtime never captures or plans on its own: where it
needs another program (an eval input signature, another rank's listing) it calls back into this module.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autopar.config import Config
from autopar.plan import Plan
from autopar.program import Program, RankSpec
from autopar.progress import Progress


def plan(model: nn.Module, mesh: DeviceMesh, example_inputs: Sequence[Any], *, example_kwargs: dict | None = None,
         loss_fn: Callable | None = None, config: Config | None = None) -> Plan:
    """Capture the model's training step and choose a placement per op; returns an inspectable Plan.

    Repeated layers are captured as a short template (Config.template_layers, default 2; None captures the
    whole model) and scaled to the model's depth, so planning time does not grow with depth. When the
    template's layers differ from one another (an op some layer lacks, or computes on other shapes), a template
    cannot stand for the others: the whole model is captured instead, with a warning."""
    from autopar.compiler import compile_plan
    from autopar.model_spec import ModelSpec

    config = config or Config()
    with Progress(enabled=config.solver.show_progress, what="planning") as prog:
        comp = compile_plan(model, mesh, example_inputs, example_kwargs=example_kwargs, loss_fn=loss_fn,
                            config=config, progress=prog)
    p = comp.plan
    p.model = ModelSpec.python(model).to_json()
    return p


def program(plan: Plan, rank: int = 0, *, model: nn.Module | None = None, example_inputs: Sequence[Any] = (),
            example_kwargs: dict | None = None, loss_fn: Callable | None = None) -> Program:
    """The Program global rank `rank` runs under `plan` (print it to read its code, collectives and buckets),
    generated on a fake mesh: no processes, no devices. The whole model is captured (a plan made on a template
    of its layers covers every layer). Without `model`, it is rebuilt from the plan's model spec (plans made
    on the command line); a plan of a live model needs the model and its example inputs again."""
    from autopar.compiler import capture_step
    from autopar.config import Config as _Config
    from autopar.mesh import fake_mesh
    from autopar.model_spec import ModelSpec

    config = _Config.from_json(plan.config) if plan.config else Config(device=plan.device)
    config = config.with_(mixed_precision=plan.mixed_precision or config.mixed_precision, device=plan.device,
                          links=dict(zip(plan.mesh.axis_names, plan.mesh.links)))
    if model is None:
        spec = plan.model_spec or ModelSpec("python", "an unrecorded model")
        built = spec.build()
        model, example_inputs, loss_fn = built.model, built.inputs, loss_fn or built.loss_fn
        example_kwargs = example_kwargs if example_kwargs is not None else built.kwargs
    mesh = fake_mesh(plan.mesh.shape, plan.mesh.axis_names, plan.mesh.device_type)
    comp = capture_step(model, mesh, example_inputs, example_kwargs, loss_fn, config, template_layers=None,
                        microbatches=plan.microbatches)
    from autopar.plan_check import check_plan

    check_plan(plan, comp)
    return comp.program(RankSpec.of_rank(plan.mesh.axis_names, plan.mesh.shape, rank), plan)


def parallelize(model: nn.Module, mesh: DeviceMesh, example_inputs: Sequence[Any] | None = None, *,
                example_kwargs: dict | None = None, loss_fn: Callable | None = None, config: Config | None = None,
                plan: Plan | None = None, seed: int | None = None, compile: bool = False):
    """Parallelize `model` over `mesh` for training: returns a ParallelModule whose call runs this rank's
    generated program and returns the loss.

    Every rank calls this with the same model (same seed, or on the meta device). Without `example_inputs`
    the module plans on its first call, with the real inputs (every rank makes that call); with them it plans
    now. Parameters belong to the ParallelModule from the start, so an optimizer made right after this call
    (`torch.optim.AdamW(pm.parameters())`) steps the sharded parameters the first call puts in place.
    Without `plan`, rank 0 plans on the full graph and broadcasts the plan. A meta-device model gets only its
    local shards allocated, initialized by `model.init_weights(seed)` (see autopar.runtime.state.init_meta).
    `seed` is also the base seed of dropout masks (autopar/codegen/rng.py); without it, rank 0's
    `torch.initial_seed()` is, sent to every rank.
    A given plan runs in the mixed precision it records, unless `config.mixed_precision` resolves to another
    one, which is refused.
    `compile=True` runs the training program's forward and backward graphs through torch.compile (inductor)
    instead of eagerly: each compiles on its first call (seconds to minutes on CPU), on every rank; the
    eval-mode programs stay eager.
    The ParallelModule keeps a reference to `model`: its eval mode captures the model's structure again (see
    `_Programs.eval_program`), so real weights of a model not on the meta device stay alive with it.
    """
    from autopar import runtime

    config = (config or Config()).with_plan_precision(plan)  # a config that leaves it open runs the plan's
    runtime.check_mesh(mesh)
    builder = _Training(model, mesh, loss_fn, config, plan, seed)
    common = dict(mesh=mesh, aliases=_aliases(model), non_persistent=runtime.non_persistent_buffers(model),
                  requires_grad={n: p.requires_grad for n, p in model.named_parameters()},
                  rng_seed=runtime.agree_on_seed(seed), compile=compile)
    if example_inputs is None:
        params, buffers = runtime.placeholder_state(model, mesh)
        return runtime.ParallelModule(params=params, buffers=buffers, build=builder.build, **common)
    built = builder.build(tuple(example_inputs), example_kwargs or {})
    # Parameters and buffers the step never reads stay as they are (replicated), as the model keeps them.
    params, buffers = runtime.placeholder_state(model, mesh, skip=set(built.params) | set(built.buffers))
    return runtime.ParallelModule(params={**params, **built.params}, buffers={**buffers, **built.buffers}, built=built,
                                  **common)


def _aliases(model: nn.Module) -> dict[str, list[str]]:
    """Parameter FQN (the first name) -> the other names of the same tensor (tied weights)."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return {names[0]: names[1:] for names in by_id.values() if len(names) > 1}


class _Training:
    """Builds a training program for given inputs: capture the whole model, agree on a plan across ranks,
    generate this rank's Program and load the weights into DTensors in its layouts."""

    def __init__(self, model: nn.Module, mesh: DeviceMesh, loss_fn: Callable | None, config: Config,
                 plan: Plan | None, seed: int | None):
        self.model, self.mesh, self.loss_fn, self.config, self.plan, self.seed = model, mesh, loss_fn, config, plan, seed

    def build(self, args: tuple, kwargs: dict):
        from autopar import runtime
        from autopar.compiler import capture_step, reject_collectives
        from autopar.model_spec import ModelSpec

        first = self.plan.microbatches if self.plan is not None else None  # None: Config's (1 for "auto")
        comp = capture_step(self.model, self.mesh, args, kwargs, self.loss_fn, self.config, template_layers=None,
                            microbatches=first)
        reject_collectives(comp.captured)
        chosen = _agree(comp, self.plan, self._make(comp, args, kwargs))
        if chosen.microbatches != comp.ctx.microbatches:  # rank 0 chose the count ("auto"): capture it here too
            from autopar.plan_check import check_plan

            comp = capture_step(self.model, self.mesh, args, kwargs, self.loss_fn, self.config,
                                template_layers=None, microbatches=chosen.microbatches)
            check_plan(chosen, comp)
        if chosen.model is None:
            chosen.model = ModelSpec.python(self.model).to_json()
        rank = runtime.rank_spec(self.mesh)
        stages = comp.stage_programs(rank, chosen) if chosen.pipeline is not None else None
        prog = stages[0] if stages else comp.program(rank, chosen)
        params, buffers = {}, {}
        for p in stages or [prog]:  # a pipeline rank holds its stages' parameters only
            ps, bs = runtime.load_state(self.model, p, self.mesh, self.seed, _aliases(self.model))
            params.update(ps)
            buffers.update(bs)
        programs = _Programs(self.model, self.mesh, self.loss_fn, self.config, comp, chosen,
                             {t.name: t.layout for t in (*prog.params, *prog.buffers)})
        return runtime.Built(prog, params, buffers, programs.eval_program, programs.of_rank, stages=stages)

    def _make(self, comp, args: tuple, kwargs: dict) -> Callable[[], Plan]:
        """How rank 0 plans: on the capture every rank made, or, when the planner chooses the microbatch count
        (Config(microbatches="auto"), or a pipeline without a count), by planning each count it weighs
        (autopar.compiler.compile_plan)."""
        from autopar.compiler import compile_plan, solve

        if isinstance(self.config.microbatches, int) or (self.config.microbatches is None
                                                         and comp.ctx.pipeline_axis is None):
            return lambda: solve(comp)
        return lambda: compile_plan(self.model, self.mesh, args, example_kwargs=kwargs, loss_fn=self.loss_fn,
                                    config=self.config, template_layers=None).plan


def _agree(comp, given: Plan | None, make: Callable[[], Plan]) -> Plan:
    """The plan every rank runs: rank 0 plans with `make` (or checks `given`) and broadcasts it; every rank
    checks it fits the graph it captured."""
    from autopar import runtime
    from autopar.compiler import fingerprint
    from autopar.plan_check import check_plan

    return runtime.agree_on_plan(make, lambda p: check_plan(p, comp), given, fingerprint(comp))


class _Programs:
    """The programs a ParallelModule asks for after it is built: forward-only eval programs per input
    signature (captured in eval mode and planned with every parameter and buffer pinned where training keeps
    it, so they read the training DTensors as they are), and the training program of another rank."""

    def __init__(self, model: nn.Module, mesh: DeviceMesh, loss_fn: Callable | None, config: Config, comp: Any,
                 plan: Plan, placements: dict[str, tuple]):
        self.model, self.mesh, self.loss_fn, self.config = model, mesh, loss_fn, config
        self.comp, self.plan, self.placements = comp, plan, placements

    def eval_program(self, args: tuple, kwargs: dict) -> Program:
        from autopar import runtime
        from autopar.compiler import capture_step, fingerprint, forward_only, reject_collectives, solve

        # Inputs are planned afresh (eval shapes may differ); activation pins name training-graph nodes.
        config = self.config.with_(pins=self.placements, input_placements=None, microbatches=None)
        with forward_only(self.model):
            comp = capture_step(self.model, self.mesh, args, kwargs, self.loss_fn, config, template_layers=None)
        reject_collectives(comp.captured)
        p = runtime.agree_on_plan(lambda: solve(comp), None, None, fingerprint(comp))
        return comp.program(runtime.rank_spec(self.mesh), p)

    def of_rank(self, rank: int) -> Program:
        names, sizes = self.plan.mesh.axis_names, self.plan.mesh.shape
        return self.comp.program(RankSpec.of_rank(names, sizes, rank, self.mesh.device_type), self.plan)


__all__ = ["plan", "parallelize", "program"]
