"""Measured peak memory of one training step, to hold the planner's memory model to: the largest total, over
the step, of the bytes of live tensor storages on this process (each storage counted once: parameters,
gradients, optimizer state, saved activations, temporaries and collective buffers), tracked through a dispatch
mode that sees every storage an op makes and a weak reference that tells when it is freed (`LiveStorages`).

    peak, parts = measure_step(module, optimizer, step)   # step(): one forward, backward, optimizer step
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

from autopar import _torch_compat as compat


def measure_step(module: Any, optimizer: Any, step: Callable[[], Any]) -> tuple[int, dict[str, int]]:
    """(peak bytes, {"state": bytes of the module's and optimizer's tensors at the start, "step": what the step
    adds at its peak}) of one call of `step`. Run a warm-up step first, so the optimizer state exists, as it does
    at every later step."""
    with LiveStorages(state_tensors(module, optimizer)) as live:
        step()
    return int(live.peak), {"state": int(live.start), "step": int(live.peak - live.start)}


class LiveStorages:
    """The bytes of live tensor storages on this process while it is entered, each storage counted once, and
    their peak: the storages of `tensors` (a model's parameters, buffers and gradients, an optimizer's state)
    from the start, and every storage an op makes or returns (a view's base included) until it is freed, which
    a weak reference to the storage tells. Unlike torch's MemTracker it registers no hooks on the module, so a
    model with frozen parameters can be measured."""

    def __init__(self, tensors=()):
        self._live: dict[int, int] = {}
        self.total = self.peak = 0
        base = compat.dispatch_mode_base()
        outer = self

        class Mode(base):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in compat.tree_leaves(out):
                    outer._see(t)
                return out

        self._mode = Mode()
        for t in tensors:
            self._see(t)
        self.start = self.total

    def _see(self, t: Any) -> None:
        import torch

        if not isinstance(t, torch.Tensor):
            return
        for x in compat.flattened_tensors(t):
            st = x.untyped_storage()
            key = id(st)
            if key in self._live or st.nbytes() == 0 or x.device.type == "meta":
                continue
            self._live[key] = st.nbytes()
            self.total += st.nbytes()
            self.peak = max(self.peak, self.total)
            weakref.finalize(st, self._free, key)  # kept alive by weakref's own registry

    def _free(self, key: int) -> None:
        self.total -= self._live.pop(key, 0)

    def __enter__(self) -> "LiveStorages":
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)


def state_tensors(module: Any, optimizer: Any) -> list:
    """A module's parameters, buffers and gradients and an optimizer's state tensors."""
    import torch

    out = [*module.parameters(), *module.buffers()]
    out += [p.grad for p in module.parameters() if p.grad is not None]
    for state in optimizer.state.values():
        out += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return out


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
