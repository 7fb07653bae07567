"""The one place that composes capture -> passes -> codegen -> runtime."""
from __future__ import annotations

import time
import warnings
from typing import Any, Callable, Sequence

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autopar.capture import capture
from autopar.config import Config
from autopar.cost import get_hardware, resolve_precision
from autopar.mesh import mesh_spec
from autopar.plan import Plan
from autopar.progress import Progress


def make_context(model: nn.Module, mesh: DeviceMesh, example_inputs: Sequence[Any], example_kwargs: dict | None,
                 loss_fn: Callable | None, config: Config | None, *, template_layers: int | None, progress=None,
                 deadline: float | None = None):
    """A pass context; planning must end by `deadline` (time.monotonic()), by default solver_time_limit_s from now."""
    from autopar.passes.context import PassContext

    config = config or Config()
    if deadline is None and config.solver_time_limit_s is not None:
        deadline = time.monotonic() + config.solver_time_limit_s
    spec = mesh_spec(mesh, dict(config.links) if config.links else None)
    device = config.device or ("cpu" if spec.device_type == "cpu" else "h100")
    hw = get_hardware(device)
    limit = int(config.memory_limit_gb * 2**30) if config.memory_limit_gb is not None else int(hw.memory_bytes)
    # One precision for both: capture autocasts to its compute dtype, the cost model prices the resulting graph.
    precision = resolve_precision(config.mixed_precision, spec.device_type)
    if progress:
        progress.update("capturing the joint forward+backward graph")
    cap = capture(model, tuple(example_inputs), example_kwargs, loss_fn, template_layers=template_layers,
                  autocast_dtype=precision.autocast_dtype)
    return PassContext(captured=cap, mesh=spec, config=config, hw=hw, precision=precision, memory_limit=limit,
                       progress=progress, deadline=deadline)


def plan(model: nn.Module, mesh: DeviceMesh, example_inputs: Sequence[Any], *, example_kwargs: dict | None = None,
         loss_fn: Callable | None = None, config: Config | None = None) -> Plan:
    """Capture the model's training step and choose a placement per op; returns an inspectable Plan.

    Repeated layers are captured as a short template (Config.template_layers, default 2; None captures the
    whole model) and scaled to the model's depth, so planning time does not grow with depth. When the
    template's layers differ from one another (an op some layer lacks, or computes on other shapes), a template
    cannot stand for the others: the whole model is captured instead, with a warning."""
    from autopar.passes import PASSES, annotate_shapes_pass, run_passes
    from autopar.passes.annotate_shapes import layer_differences

    config = config or Config()
    with Progress(enabled=config.solver.show_progress, what="planning") as prog:
        ctx = make_context(model, mesh, example_inputs, example_kwargs, loss_fn, config,
                           template_layers=config.template_layers, progress=prog)
        run_passes(ctx.captured.gm, ctx, (annotate_shapes_pass,))
        differ = layer_differences(ctx) if any(b.captured < b.count for b in ctx.captured.blocks) else []
        if differ:
            warnings.warn(f"the {config.template_layers} template layers differ ({differ[0]}): they cannot stand "
                          "for the model's other layers, so the whole model is captured instead; pass "
                          "Config(template_layers=None) to capture it whole from the start", stacklevel=2)
            ctx = make_context(model, mesh, example_inputs, example_kwargs, loss_fn, config, template_layers=None,
                               progress=prog, deadline=ctx.deadline)
            run_passes(ctx.captured.gm, ctx, (annotate_shapes_pass,))
        run_passes(ctx.captured.gm, ctx, tuple(p for p in PASSES if p is not annotate_shapes_pass))
    p = ctx.plan
    p.solver_stats["capture_seconds"] = ctx.captured.capture_seconds
    p.context = ctx
    p.source = (model, mesh, tuple(example_inputs), example_kwargs, loss_fn, config)  # for plan.compare()
    return p
