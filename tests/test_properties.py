"""Property tests: random models, batch sizes and meshes give valid plans."""
from __future__ import annotations

import dataclasses

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import autopar
from autopar.compiler import compile_plan
from autopar.layout import divides
from autopar.models.llama import LLAMA_TINY, Llama, cross_entropy_loss
from autopar.redistribute import plan_steps
from autopar.rules.base import op_info

QUIET = autopar.SolverConfig(show_progress=False)
SETTINGS = settings(max_examples=6, derandomize=True, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def _check_plan_valid(comp, limit_bytes: int) -> None:
    p, ctx = comp.plan, comp.ctx
    sizes = ctx.mesh.shape
    for key, strats in ctx.strategies.items():
        node = ctx.members[key][0]
        s = ctx.chosen(key)
        if node.op == "call_function" and key in p.nodes:
            info = op_info(node)
            for meta, lay in zip(info.inputs, s.ins):
                assert divides(meta.shape, lay, sizes), (key, meta.shape, lay)
            for meta, lay in zip(info.outputs, s.outs):
                assert meta is None or divides(meta.shape, lay, sizes), (key, meta.shape, lay)
    for t in p.transitions:  # every edge has a legal transition
        assert plan_steps(t.src_layout, t.dst_layout) or t.src_layout == t.dst_layout
    assert p.peak_memory_per_rank <= limit_bytes


@SETTINGS
@given(depth=st.integers(1, 3), width=st.sampled_from([32, 64, 96]), batch=st.sampled_from([4, 8, 12]),
       mesh=st.sampled_from([(2,), (4,), (2, 2), (3,)]))
def test_random_mlps_plan_validly(depth, width, batch, mesh):
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 4))

    def loss_fn(out, x):
        return out.pow(2).mean()

    names = ("dp", "tp")[: len(mesh)]
    comp = compile_plan(model, autopar.fake_mesh(mesh, names, device_type="cpu"), (torch.randn(batch, width),),
                        loss_fn=loss_fn, config=autopar.Config(solver=QUIET))
    _check_plan_valid(comp, int(64e9))


@SETTINGS
@given(layers=st.integers(1, 3), heads=st.sampled_from([2, 4]), seq=st.sampled_from([8, 16]),
       batch=st.sampled_from([2, 4]), mesh=st.sampled_from([(2,), (2, 2), (4,)]))
def test_random_llamas_plan_validly_under_a_memory_limit(layers, heads, seq, batch, mesh):
    cfg = dataclasses.replace(LLAMA_TINY, n_layers=layers, n_heads=heads, n_kv_heads=heads // 2)
    model = Llama(cfg)
    names = ("dp", "tp")[: len(mesh)]
    limit_gb = 0.004
    cfg_ = autopar.Config(solver=QUIET, memory_limit_gb=limit_gb)
    try:
        comp = compile_plan(model, autopar.fake_mesh(mesh, names, device_type="cpu"),
                            (torch.zeros(batch, seq, dtype=torch.long),), loss_fn=cross_entropy_loss, config=cfg_)
    except autopar.InfeasibleMemoryError as e:
        assert "smallest plan found needs" in str(e)
        return
    _check_plan_valid(comp, int(limit_gb * 2**30))
