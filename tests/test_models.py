"""Real models from transformers, and a small convolutional network, plan at scale without missing rules."""
from __future__ import annotations

import warnings

import pytest
import torch

import autopar
from autopar.testing.hf_models import IMAGE_MODELS, MODELS

pytest.importorskip("transformers")

QUIET = autopar.SolverConfig(show_progress=False)


def _plan_on_fake_8x8(model, args, kwargs):
    mesh = autopar.fake_mesh((8, 8), ("dp", "tp"))
    cfg = autopar.Config(device="h100", links={"dp": "ib", "tp": "nvlink"}, solver=QUIET)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a missing rule warns: fail on it
        return autopar.plan(model, mesh, args, example_kwargs=kwargs, config=cfg)


FAST = {"llama", "gpt2", "bert", "vit"}  # make test-fast plans these; make test all of them


@pytest.mark.parametrize("name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in sorted(MODELS)])
def test_hf_model_plans_on_fake_8x8_without_missing_rules(name):
    torch.manual_seed(0)
    model, args, kwargs = MODELS[name](batch=8, **({} if name in IMAGE_MODELS else {"seq": 64}))
    p = _plan_on_fake_8x8(model, args, kwargs)
    assert p.estimated_step_time > 0 and p.peak_memory_per_rank > 0
    # One entry per parameter; tied weights (one tensor under two names) are one entry.
    names = dict(model.named_parameters(remove_duplicate=False))
    planned = set(p.param_placements())
    assert planned <= set(names)
    assert len({id(names[n]) for n in planned}) == len(planned) == len({id(t) for t in names.values()})


def test_small_cnn_plans_on_fake_8x8_without_missing_rules():
    from test_rules_vision import small_cnn

    torch.manual_seed(0)
    model = small_cnn()
    x, labels = torch.randn(64, 3, 16, 16), torch.randint(0, 10, (64,))
    p = _plan_on_fake_8x8(model, (x, labels), {})
    assert p.estimated_step_time > 0
    assert set(p.param_placements()) == {n for n, _ in model.named_parameters()}
