"""The two-argument form: `parallelize(model, mesh)` plans on the first call, and an optimizer made before it
steps the sharded parameters."""
from __future__ import annotations

import math

import pytest
import torch

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
