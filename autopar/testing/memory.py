"""Measured peak memory of one training step, to hold the planner's memory model to: the largest total, over
the step, of the bytes of live tensor storages on this process (each storage counted once: parameters,
gradients, optimizer state, saved activations, temporaries and collective buffers), as
torch.distributed._tools.mem_tracker tracks them through a dispatch mode.

    peak, parts = measure_step(module, optimizer, step)   # step(): one forward, backward, optimizer step
"""
from __future__ import annotations

from typing import Any, Callable

from autopar import _torch_compat as compat


def measure_step(module: Any, optimizer: Any, step: Callable[[], Any]) -> tuple[int, dict[str, int]]:
    """(peak bytes, {kind: bytes at that peak}) of one call of `step`. Run a warm-up step first, so the
    optimizer state exists, as it does at every later step."""
    tracker = compat.memory_tracker()
    tracker.track_external(module, optimizer)
    with tracker:
        step()
    snap = tracker.get_tracker_snapshot("peak")
    dev = max(snap, key=lambda d: snap[d]["Total"])
    parts = {str(getattr(k, "value", k)): int(v) for k, v in snap[dev].items() if k != "Total"}
    return int(snap[dev]["Total"]), parts


def measure_plan_step(build: Callable[[], tuple], plan_json: str, lr: float = 1e-3) -> dict:
    """On every rank of a gloo pool (autopar.testing.dist): parallelize `build()`'s (model, inputs, loss_fn) or
    (model, inputs, loss_fn, kwargs) under the plan (a model without loss_fn returns its loss, or an output with
    `.loss`, as transformers models do), run a warm-up step of AdamW, and measure the next step
    (`measure_step`)."""
    import torch
    from autopar.testing.dist import cpu_mesh

    import autopar
    from autopar.plan import Plan

    plan = Plan.from_json(plan_json)
    model, inputs, loss_fn, *rest = build()
    kwargs = rest[0] if rest else {}
    mesh = cpu_mesh(tuple(plan.mesh.shape), tuple(plan.mesh.axis_names))
    pm = autopar.parallelize(model, mesh, inputs, example_kwargs=kwargs or None, loss_fn=loss_fn, plan=plan, seed=0)
    opt = torch.optim.AdamW(pm.parameters(), lr=lr)

    def step() -> None:
        opt.zero_grad()
        out = pm(*inputs, **kwargs)
        getattr(out, "loss", out).backward()
        opt.step()

    step()
    peak, parts = measure_step(pm, opt, step)
    return {"peak": peak, "parts": parts}


def build_hf(name: str, batch: int = 4, seq: int = 16) -> tuple:
    """A small transformers model of autopar.testing.hf_models as measure_plan_step takes it: (model, inputs,
    None, keyword inputs); `seq` tokens per sequence for a text model."""
    import torch

    from autopar.testing import hf_models

    torch.manual_seed(0)
    model, args, kwargs = hf_models.MODELS[name](batch=batch, **({} if name in hf_models.IMAGE_MODELS else
                                                                  {"seq": seq}))
    return model, args, None, kwargs or {}
