"""The torch.compile backend (autopar.backend): a compiled module trains like the one-device model and like
`parallelize()` on 4 gloo ranks, its parameters become DTensors in place, no recompile follows the first call,
and what it cannot run is refused with a message that says what to change."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

import autopar
from autopar.testing.compare import assert_all_close
from autopar.testing.dist import get_pool
from test_execution import (CLIP, LR, MESHES, QUIET, STEPS, _full, _mesh, _pinned_config, build,
                            check_against_reference, reference)

DP2XTP2 = MESHES["dp2xtp2"]


class Step(nn.Module):
    """A model and its loss as one module, as a user compiles it: returns (loss, model output)."""

    def __init__(self, model: nn.Module, loss_fn):
        super().__init__()
        self.model, self.loss_fn = model, loss_fn

    def forward(self, *inputs):
        out = self.model(*inputs)
        return self.loss_fn(out, *inputs), out


def _config(name: str, step: Step, inputs, shape, names, kind: str) -> autopar.Config:
    """The solver's plan, or a forced sharded one (FSDP over dp and Megatron over tp, as Config pins)."""
    if kind == "solver":
        return autopar.Config(solver=QUIET)
    if name.startswith("hf_"):
        return autopar.Config(solver=QUIET, **_pinned_config(name, step, inputs, shape, names, kind))
    fields = _pinned_config(name, step.model, inputs, shape, names, kind)
    pins = {k if k == "*" else f"model.{k}": v for k, v in fields["pins"].items()}
    return autopar.Config(solver=QUIET, pins=pins)


def _unprefixed(named) -> dict:
    return {n.removeprefix("model."): t for n, t in named}


def train_compiled(name: str, shape, names, kind: str, inner: str = "eager") -> dict:
    """Three AdamW steps of the compiled module (the optimizer made after the first call, FSDP2's convention),
    recording what the comparison with one device reads, and how often Dynamo compiled and autopar planned."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model, inputs, loss_fn = build(name)
    if name == "hf_gpt2":  # else its loss function logs a warning, a graph break before the loss
        model.model.loss_type = "ForCausalLM"
    step = Step(model, loss_fn)
    mesh = _mesh(shape, names)
    b = autopar.backend(mesh, config=_config(name, step, inputs, shape, names, kind), inner=inner)
    cm = torch.compile(step, backend=b, dynamic=False)
    out = {"losses": []}
    loss, output = cm(*inputs)
    opt = torch.optim.AdamW(step.parameters(), lr=LR, eps=1e-6)
    for i in range(STEPS):
        if i:
            opt.zero_grad()
            loss, output = cm(*inputs)
        loss.backward()
        if i == 0:
            out["grads"] = {k: _full(p.grad) for k, p in _unprefixed(step.named_parameters()).items()}
            out["grad_types"] = {type(p.grad).__name__ for p in step.parameters() if p.grad is not None}
        norm = torch.nn.utils.clip_grad_norm_(list(step.parameters()), CLIP)
        if i == 0:
            out["norm"] = _full(norm).item()
        opt.step()
        out["losses"].append(loss.item())
    out["weights"] = {k: _full(p).detach() for k, p in _unprefixed(step.named_parameters()).items()}
    out["placements"] = {k: tuple(p.placements) for k, p in _unprefixed(step.named_parameters()).items()}
    out["state_dict_types"] = {type(v).__name__ for v in step.state_dict().values()}
    out["output"] = (type(output).__name__, tuple(getattr(output, "placements", ())))
    out["loss_type"] = type(loss).__name__
    out["dynamo_graphs"] = counters["stats"]["unique_graphs"]
    out["backend"] = dict(b.stats)
    return out if torch.distributed.get_rank() == 0 else {"losses": out["losses"]}


def _check_tight(name: str, results: list[dict]) -> None:
    """Losses on every rank and the first step's gradients within 1e-5 (relative, atol 1e-5 of each tensor's
    largest entry) of one device: tight enough that a wrong or missing collective fails."""
    ref = reference(name)
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6)
    for k, want in ref["grads"].items():
        got = results[0]["grads"][k]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item() + 1e-12, msg=k)


def _sharded(placements: dict) -> bool:
    return any(isinstance(p, Shard) for lay in placements.values() for p in lay)


CASES = [("mlp", "solver"), ("mlp", "fsdp_tp"), ("llama", "solver"), ("llama", "fsdp_tp"),
         ("hf_llama", "fsdp_tp"), ("hf_gpt2", "fsdp"), ("hf_bert", "fsdp")]
FAST = {("llama", "fsdp_tp")}


@pytest.mark.parametrize("name,kind", [pytest.param(*c, id="-".join(c), marks=() if c in FAST else pytest.mark.slow)
                                       for c in CASES])
def test_compiled_module_matches_single_device(name, kind):
    shape, names = DP2XTP2
    results = get_pool(math.prod(shape)).run(train_compiled, name, shape, names, kind)
    got = results[0]
    # One Dynamo graph, planned once: the parameters were sharded before Dynamo built its guards.
    assert got["dynamo_graphs"] == 1 and got["backend"] == {"compiles": 1, "planned": 1, "reused": 0}, got
    assert got["grad_types"] == {"DTensor"} and got["state_dict_types"] <= {"DTensor"}
    assert got["loss_type"] == "Tensor"
    if kind != "solver":
        assert _sharded(got["placements"]), got["placements"]
    check_against_reference(name, results)
    _check_tight(name, results)
