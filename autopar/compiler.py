"""The one compiler driver: capture -> passes -> Plan -> codegen -> per-rank Program.

`autopar.plan`, `autopar.parallelize`, `autopar.program`, the command line, recipe comparisons and the eval
programs of a ParallelModule all compile through these functions; the runtime only runs the Programs they
return (and asks for more through the callables `autopar.api` hands it).
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
import warnings
from typing import Any, Callable, Iterator, Sequence

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autopar.capture import Captured, capture
from autopar.config import Config
from autopar.cost import get_hardware, resolve_precision
from autopar.mesh import mesh_spec
from autopar.plan import Plan
from autopar.program import Program, RankSpec


@dataclasses.dataclass
class Compilation:
    """One capture of a model's step and what the passes derived from it (`ctx`, the PassContext: the graph,
    plan keys, strategies, costs, the solver's choice and the simulated step), and the Plan when planned."""

    ctx: Any

    @property
    def captured(self) -> Captured:
        return self.ctx.captured

    @property
    def plan(self) -> Plan:
        return self.ctx.plan

    def program(self, rank: RankSpec, plan: Plan | None = None) -> Program:
        """The Program of `rank` under `plan` (default: the plan made here); for a pipelined plan, that of the
        first stage the rank runs (stage_programs has them all)."""
        from autopar.codegen import generate

        plan = plan or self.plan
        if plan.pipeline is not None:
            return self.stage_programs(rank, plan)[0]
        return generate(plan, self.captured, rank)

    def stage_programs(self, rank: RankSpec, plan: Plan | None = None) -> list[Program]:
        """A pipelined plan's Programs of the stages `rank` runs."""
        from autopar.codegen import generate_stages

        return generate_stages(plan or self.plan, self.captured, rank)


def capture_step(model: nn.Module, mesh: DeviceMesh, example_inputs: Sequence[Any], example_kwargs: dict | None,
                 loss_fn: Callable | None, config: Config | None, *, template_layers: int | None,
                 progress: Any = None, deadline: float | None = None,
                 microbatches: int | None = None, read_state_only: bool = False) -> Compilation:
    """Capture the model's step on `mesh` and key its nodes (the first pass), ready to plan or to check a plan
    against. Planning must end by `deadline` (time.monotonic()); by default Config.solver_time_limit_s from now.
    With `microbatches` m > 1 (default: Config.microbatches when it is a number, else 1) the example inputs are
    the global batch and the graph is traced on one microbatch of it (every tensor input's dim 0 divided by m).
    `read_state_only`: leave out the parameters and buffers the step does not read (autopar.capture.capture)."""
    from autopar.microbatch import first_microbatch
    from autopar.passes import annotate_shapes_pass
    from autopar.passes.context import PassContext

    config = config or Config()
    if deadline is None and config.solver_time_limit_s is not None:
        deadline = time.monotonic() + config.solver_time_limit_s
    if microbatches is None:
        microbatches = config.microbatches if isinstance(config.microbatches, int) else 1
    example_inputs, example_kwargs = first_microbatch(tuple(example_inputs), example_kwargs, microbatches)
    spec = mesh_spec(mesh, dict(config.links) if config.links else None, config.device)
    device = config.device or ("cpu" if spec.device_type == "cpu" else "h100")
    hw = get_hardware(device)
    limit = int(config.memory_limit_gb * 2**30) if config.memory_limit_gb is not None else int(hw.memory_bytes)
    # One precision for both: capture autocasts to its compute dtype, the cost model prices the resulting graph.
    precision = resolve_precision(config.mixed_precision, spec.device_type)
    if progress:
        progress.update("capturing the joint forward+backward graph")
    cap = capture(model, tuple(example_inputs), example_kwargs, loss_fn, template_layers=template_layers,
                  autocast_dtype=precision.autocast_dtype, batch_norm_sums=config.sync_batch_norm,
                  read_state_only=read_state_only)
    if microbatches > 1 and cap.batch_norms:
        raise ValueError(f"batch norm in training mode ({cap.batch_norms[0]}) would compute its statistics over each "
                         f"microbatch, not over the global batch, under microbatches={microbatches}: use "
                         "Config(microbatches=1), put the batch norms in eval mode (running statistics), or use "
                         "GroupNorm / LayerNorm")
    ctx = PassContext(captured=cap, mesh=spec, config=config, hw=hw, precision=precision, memory_limit=limit,
                      progress=progress, deadline=deadline, microbatches=microbatches,
                      pipeline_axis=spec.pipeline_axis)
    annotate_shapes_pass(cap.gm, ctx)
    return Compilation(ctx)


@contextlib.contextmanager
def _heap_frozen():
    """Leave the objects alive when the passes start (the model, its captured graph, torch's own) out of the
    garbage collector's full passes until they end: the solver's programs allocate millions of small objects,
    and each full pass otherwise walks that whole heap again (Llama-3-8B at its smallest feasible peak on 8x8:
    the full passes during the passes took 0.61 s without this and 0.33 s with it). The outermost call freezes
    and unfreezes."""
    outermost = gc.get_freeze_count() == 0
    if outermost:
        gc.freeze()
    try:
        yield
    finally:
        if outermost:
            gc.unfreeze()


def solve(comp: Compilation, passes: Sequence[Callable] | None = None) -> Plan:
    """Run the passes after annotate_shapes (or `passes`, e.g. with a pass standing in for the solver) and
    return the Plan."""
    from autopar.passes import PASSES, annotate_shapes_pass, run_passes

    passes = tuple(p for p in (PASSES if passes is None else passes) if p is not annotate_shapes_pass)
    with _heap_frozen():
        run_passes(comp.captured.gm, comp.ctx, passes)
    plan = comp.ctx.plan
    plan.config = comp.ctx.config.to_json()
    timings = {"capture_s": comp.captured.capture_seconds}
    timings.update({name.removesuffix("_pass") + "_s": t for name, t in comp.ctx.timings.items()})
    plan.timings.update({k: float(f"{v:.3g}") for k, v in timings.items()})
    return plan


def compile_plan(model: nn.Module, mesh: DeviceMesh, example_inputs: Sequence[Any], *,
                 example_kwargs: dict | None = None, loss_fn: Callable | None = None, config: Config | None = None,
                 template_layers: Any = "config", passes: Sequence[Callable] | None = None,
                 progress: Any = None) -> Compilation:
    """Capture and plan. Repeated layers are captured as a template of `template_layers` layers (default
    Config.template_layers) when they are alike; layers that differ make it capture the whole model, with a
    warning."""
    from autopar.passes.annotate_shapes import layer_differences

    config = config or Config()
    layers = config.template_layers if template_layers == "config" else template_layers
    pp = _pipeline_size(mesh, config)
    if config.pipeline == "auto" and pp == 1 and _pipeline_axis(mesh) is None:
        return _auto_pipeline(model, mesh, example_inputs, example_kwargs, loss_fn, config, layers, passes, progress)
    if pp > 1 and not isinstance(config.microbatches, int):
        return _pipeline_microbatches(model, mesh, example_inputs, example_kwargs, loss_fn, config, layers, passes,
                                      progress, pp)
    if config.microbatches == "auto":
        return _auto_microbatches(model, mesh, example_inputs, example_kwargs, loss_fn, config, layers, passes,
                                  progress)
    comp = capture_step(model, mesh, example_inputs, example_kwargs, loss_fn, config, template_layers=layers,
                        progress=progress)
    truncated = any(b.captured < b.count for b in comp.captured.blocks)
    differ = layer_differences(comp.ctx) if truncated else []
    if differ:
        warnings.warn(f"the {layers} template layers differ ({differ[0]}): they cannot stand for the model's other "
                      "layers, so the whole model is captured instead; pass Config(template_layers=None) to "
                      "capture it whole from the start", stacklevel=3)
        comp = capture_step(model, mesh, example_inputs, example_kwargs, loss_fn, config, template_layers=None,
                            progress=progress, deadline=comp.ctx.deadline)
    solve(comp, passes)
    return comp


def _pipeline_axis(mesh: DeviceMesh) -> int | None:
    from autopar.mesh import pipeline_axis

    return pipeline_axis(mesh.mesh_dim_names or ())


def _pipeline_size(mesh: DeviceMesh, config: Config) -> int:
    axis = _pipeline_axis(mesh)
    return 1 if axis is None else int(mesh.mesh.shape[axis])


# Pipeline sizes Config(pipeline="auto") weighs: divisors of the outermost axis from 2 up to this.
AUTO_PIPELINE_MAX = 8


def _auto_pipeline(model, mesh, example_inputs, example_kwargs, loss_fn, config: Config, layers, passes,
                   progress) -> Compilation:
    """Config(pipeline="auto") on a mesh without a pipeline axis: the plan of the mesh as it is, and of the mesh
    with its outermost axis factored into pp x the rest for each pipeline size k dividing it (2 <= k <=
    AUTO_PIPELINE_MAX, at most the model's layers); the fastest that fits wins. Its plan names the mesh it
    assumes (plan.mesh), which parallelize needs built from the same ranks."""
    from autopar.errors import InfeasibleMemoryError
    from autopar.mesh import fake_mesh, target_device_type
    from autopar.microbatch import divisors

    names, shape = tuple(mesh.mesh_dim_names), tuple(int(s) for s in mesh.mesh.shape)
    flat = config.with_(pipeline=None)
    found, errors = [], []
    meshes = [mesh] + [fake_mesh((k, shape[0] // k, *shape[1:]), ("pp", *names), target_device_type(mesh, config.device))
                       for k in divisors(shape[0]) if 2 <= k <= AUTO_PIPELINE_MAX]
    for candidate in meshes:
        try:
            found.append(compile_plan(model, candidate, example_inputs, example_kwargs=example_kwargs,
                                      loss_fn=loss_fn, config=flat, template_layers=layers, passes=passes,
                                      progress=progress))
        except InfeasibleMemoryError as e:
            errors.append(e)
        except ValueError as e:  # more stages than layers, a model pipelines cannot cut
            if candidate is mesh:
                raise
            errors.append(e)
    if not found:
        raise InfeasibleMemoryError(f"no plan fits with or without pipeline stages: {errors[0]}")
    best = min(found, key=lambda c: c.plan.estimated_step_time)
    best.plan.config = config.to_json()
    return best


# Microbatch counts a pipeline plan weighs: the smallest divisors of the batch from the pipeline's size up.
PIPELINE_MICROBATCH_CANDIDATES = 3


def _pipeline_microbatches(model, mesh, example_inputs, example_kwargs, loss_fn, config: Config, layers, passes,
                           progress, pp: int) -> Compilation:
    """A pipeline's microbatch count, chosen with its schedule: each candidate count (a divisor of the batch of
    at least the pipeline's size; the smallest few) is captured and planned, and the fastest plan that fits
    wins. More microbatches shrink the bubble and the activations in flight but make each op smaller."""
    from autopar.errors import InfeasibleMemoryError
    from autopar.microbatch import batch_rows, divisors

    rows = batch_rows(tuple(example_inputs), dict(example_kwargs or {})) or 1
    counts = [m for m in divisors(rows) if m >= pp][:PIPELINE_MICROBATCH_CANDIDATES]
    if not counts:
        raise ValueError(f"a pipeline of {pp} stages needs at least {pp} microbatches, and the batch has {rows} "
                         f"rows along dim 0: use a batch of at least {pp} rows or a shorter pipeline axis")
    best, errors = None, []
    for m in counts:
        try:
            comp = compile_plan(model, mesh, example_inputs, example_kwargs=example_kwargs, loss_fn=loss_fn,
                                config=config.with_(microbatches=m), template_layers=layers, passes=passes,
                                progress=progress)
        except InfeasibleMemoryError as e:
            errors.append(e)
            continue
        if best is None or comp.plan.estimated_step_time < best.plan.estimated_step_time:
            best = comp
    if best is None:
        raise InfeasibleMemoryError(f"{errors[-1]} (tried microbatches {', '.join(map(str, counts))})")
    best.plan.config = config.to_json()
    return best


def _auto_microbatches(model, mesh, example_inputs, example_kwargs, loss_fn, config: Config, layers, passes,
                       progress) -> Compilation:
    """Config(microbatches="auto") without a pipeline: the fewest microbatches (a divisor of the batch) whose
    plan fits the memory limit. More microbatches never make a step faster under the cost model (the same
    work in smaller pieces, parameter gathers repeated per microbatch), so the first that fits is the choice."""
    from autopar.errors import InfeasibleMemoryError
    from autopar.microbatch import batch_rows, divisors

    rows = batch_rows(tuple(example_inputs), dict(example_kwargs or {})) or 1
    error: InfeasibleMemoryError | None = None
    for m in divisors(rows):
        try:
            comp = compile_plan(model, mesh, example_inputs, example_kwargs=example_kwargs, loss_fn=loss_fn,
                                config=config.with_(microbatches=m), template_layers=layers, passes=passes,
                                progress=progress)
        except InfeasibleMemoryError as e:
            error = e
            continue
        comp.plan.config = config.to_json()  # the plan records what was asked ("auto") and what it chose
        return comp
    assert error is not None
    raise InfeasibleMemoryError(f"{error} (tried microbatches {', '.join(map(str, divisors(rows)))})") from error


def fingerprint(comp: Compilation) -> str:
    """Identity of the captured graph (ops, shapes and counts behind every plan key, depth and mesh)."""
    from autopar.passes.build_plan import fingerprint as graph_fingerprint

    return graph_fingerprint(comp.ctx)


def reject_collectives(cap: Captured) -> None:
    """A model that already communicates (DTensor, FSDP/TP wrappers, explicit collectives) is refused."""
    from autopar import _torch_compat as compat

    for node in cap.gm.graph.nodes:
        ns, _ = compat.op_namespace_and_name(node.target)
        if node.op == "call_function" and ns in compat.C10D_NAMESPACES:
            raise ValueError(f"the model already communicates: {node.target} in {cap.module_of.get(node) or 'the root'} "
                             f"({cap.names.get(node, node.name)}). autopar inserts every collective itself; pass the "
                             "single-device model, without explicit collectives, DTensor or FSDP/TP wrappers")


@contextlib.contextmanager
def forward_only(model: nn.Module) -> Iterator[None]:
    """The model in eval mode with no parameter requiring grad (so a trace has no backward); every module's
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


__all__ = ["Compilation", "capture_step", "solve", "compile_plan", "fingerprint", "reject_collectives", "forward_only"]
