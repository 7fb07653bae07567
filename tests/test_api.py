"""The two-argument form: `parallelize(model, mesh)` plans on the first call, and an optimizer made before it
steps the sharded parameters."""
from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import autopar
from autopar.plan import Plan
from autopar.testing.dist import get_pool
from test_execution import MESHES, _mesh, _train, build, check_against_reference, plan_json


def train_deferred(name, shape, names, plan: str | None) -> dict:
    model, inputs, loss_fn = build(name)
    pm = autopar.parallelize(model, _mesh(shape, names), loss_fn=loss_fn,
                             plan=Plan.from_json(plan) if plan else None)
    before = {n: id(p) for n, p in pm.named_parameters()}
    try:
        pm.input_placements
        not_planned = None
    except ValueError as e:
        not_planned = str(e)
    res = _train(pm, inputs, loss_fn, distributed=True)  # the optimizer is made before the first call
    res["same_objects"] = before == {n: id(p) for n, p in pm.named_parameters()}
    res["placements"] = {n: tuple(p.placements) for n, p in pm.named_parameters()}
    res["not_planned"] = not_planned
    return res if torch.distributed.get_rank() == 0 else {"losses": res["losses"]}


@pytest.mark.parametrize("plan_kind", ["fsdp_tp", None], ids=["given-sharded-plan", "planned-on-first-call"])
def test_parallelize_without_example_inputs_plans_on_the_first_call(plan_kind):
    shape, names = MESHES["dp2xtp2"]
    pool = get_pool(math.prod(shape))
    plan = plan_json("llama", shape, names, plan_kind) if plan_kind else None
    results = pool.run(train_deferred, "llama", shape, names, plan)
    got = results[0]
    assert got["same_objects"] and "plans on its first call" in got["not_planned"]
    if plan_kind:
        want = Plan.from_json(plan).param_placements()
        assert got["placements"] == {n: want[n] for n in got["placements"]}
        assert any(any(type(p).__name__ == "Shard" for p in lay) for lay in got["placements"].values())
    check_against_reference("llama", results)


def _loss_and_logits(out, tokens):
    from autopar.models import cross_entropy_loss

    return cross_entropy_loss(out, tokens), out


def train_with_outputs(plan: str) -> dict:
    model, inputs, _ = build("llama")
    pm = autopar.parallelize(model, _mesh((2, 2), ("dp", "tp")), inputs, loss_fn=_loss_and_logits,
                             plan=Plan.from_json(plan))
    loss, logits = pm(*inputs)
    loss.backward()
    grads = {n: p.grad.full_tensor() for n, p in pm.named_parameters()}
    pm.eval()
    with torch.no_grad():
        eval_loss, eval_logits = pm(*inputs)
    return {"loss": loss.item(), "placements": tuple(logits.placements), "requires_grad": logits.requires_grad,
            "logits": logits.full_tensor(), "grads": grads, "eval_logits": eval_logits.full_tensor()}


def test_a_loss_function_may_return_other_outputs_as_dtensors():
    """loss_fn returning (loss, logits): the call returns the logits too, as a DTensor in its planned layout
    (no gather), not differentiated; the gradients are the loss's alone."""
    from autopar.compiler import compile_plan

    model, inputs, _ = build("llama")
    comp = compile_plan(model, autopar.fake_mesh((2, 2), ("dp", "tp"), "cpu"), inputs, loss_fn=_loss_and_logits,
                        config=autopar.Config(solver=autopar.SolverConfig(show_progress=False),
                                              pins={"*": (Shard(0), Replicate())}), template_layers=None)
    got = get_pool(4).run(train_with_outputs, comp.plan.to_json())[0]
    model, inputs, loss_fn = build("llama")
    logits = model(*inputs)
    loss = loss_fn(logits, *inputs)
    loss.backward()
    assert got["placements"] != (Replicate(), Replicate()) and not got["requires_grad"]
    torch.testing.assert_close(got["logits"], logits.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["eval_logits"], model.eval()(*inputs).detach(), rtol=1e-5, atol=1e-5)
    assert got["loss"] == pytest.approx(loss.item(), rel=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(got["grads"][n], p.grad, rtol=1e-4, atol=1e-4 * p.grad.abs().max().item())
