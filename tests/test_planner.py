"""Planner golden tests: the solver must pick what an expert would write by hand."""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard

import autopar
from autopar.compiler import compile_plan
from autopar.models.llama import LLAMA3_8B, LLAMA3_70B, LLAMA_SMALL, Llama, cross_entropy_loss

QUIET = autopar.SolverConfig(show_progress=False)


class MLP(nn.Module):
    def __init__(self, dims: list[int]):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))

    def forward(self, x, y=None):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.gelu(x)
        return x


def mse(out, x, y):
    return F.mse_loss(out, y)


def compile_mlp(dims, batch, mesh, **cfg):
    """The MLP planned; the Compilation, whose `.plan` is what autopar.plan returns and `.captured` its graph."""
    with torch.device("meta"):
        model = MLP(dims)
    x, y = torch.zeros(batch, dims[0]), torch.zeros(batch, dims[-1])
    return compile_plan(model, mesh, (x, y), loss_fn=mse, config=autopar.Config(solver=QUIET, **cfg))


def plan_mlp(dims, batch, mesh, **cfg):
    return compile_mlp(dims, batch, mesh, **cfg).plan


def test_small_model_large_batch_gets_data_parallel():
    p = plan_mlp([1024, 4096, 1024], 65536, autopar.fake_mesh(8, "dp"), device="h100")
    assert p.inputs[0] == (Shard(0),)
    # Every matmul works on its batch shard; the only collectives move parameters and gradients (an
    # optimizer-state shard, ZeRO style, is still data parallelism).
    for key, node in p.nodes.items():
        if node.op == "aten.addmm.default":
            assert node.outs[0] == (Shard(0),), (key, node.outs)
    assert all(t.kind in ("param", "grad", "loss") for t in p.transitions), [(t.src, t.dst) for t in p.transitions]
    assert p.techniques & {"dp", "fsdp"} and "tp" not in p.techniques


def test_wide_mlp_small_batch_gets_megatron_column_then_row():
    comp = compile_mlp([2048, 32768, 2048], 256, autopar.fake_mesh(8, "tp"), device="h100")
    p = comp.plan
    pl = p.param_placements()
    assert pl["layers.0.weight"] == (Shard(0),), pl  # column parallel: output features split
    assert pl["layers.0.bias"] == (Shard(0),)
    assert pl["layers.1.weight"] == (Shard(1),), pl  # row parallel: input features split
    # The wide hidden activation never moves; the row-parallel output is a partial sum reduced once on its
    # way to the loss (all-reduce, or reduce-scatter when the loss runs sharded).
    assert p.nodes["layers.1/fwd/addmm"].outs[0] == (Partial(),)
    # (Under bf16 mixed precision a value may move as its cast: the input's bf16 copy, the output's fp32 copy
    # for the loss.)
    moved = [t for t in p.transitions if t.kind == "activation" and "/fwd/" in t.dst]
    assert all(_uncast(comp.captured, t.src) in ("input/0", "layers.1/fwd/addmm") for t in moved), \
        [(t.src, t.dst) for t in moved]
    reductions = [t for t in moved if _uncast(comp.captured, t.src) == "layers.1/fwd/addmm"]
    assert len(reductions) == 1 and reductions[0].steps.split("[")[0] in ("all_reduce", "reduce_scatter")
    assert "tp" in p.techniques


def _uncast(cap, key: str) -> str:
    """The node a plan key names, or the value it casts (through dtype casts)."""
    node = cap.nodes.get(key)
    while node is not None and node.target is torch.ops.aten._to_copy.default:
        node = node.args[0]
    return key if node is None else cap.names[node]


def test_model_too_big_for_replication_gets_fsdp():
    dims = [4096] * 5  # 4 x 16.8M params x 16 bytes = 1.07 GB replicated
    # A batch 4x the width: at a batch equal to the width, a layer's bf16 activation is as large as its bf16
    # weight, and tensor + sequence parallelism on the one axis (gather activations, not weights) is as cheap.
    p = plan_mlp(dims, 16384, autopar.fake_mesh(8, "dp"), device="h100", memory_limit_gb=0.6)
    for fqn, lay in p.param_placements().items():
        if fqn.endswith("weight"):
            assert isinstance(lay[0], Shard), (fqn, lay)
    assert p.inputs[0] == (Shard(0),)
    assert "fsdp" in p.techniques
    assert p.peak_memory_per_rank <= 0.6 * 2**30


def _plan_70b(memory_limit_gb: float):
    with torch.device("meta"):
        model = Llama(LLAMA3_70B)
    mesh = autopar.fake_mesh((8, 8), ("dp", "tp"))
    cfg = autopar.Config(device="h100", links={"dp": "ib", "tp": "nvlink"}, memory_limit_gb=memory_limit_gb,
                         solver=QUIET)
    # Two 8192-token sequences per data-parallel rank: with every layer's saved activations counted, no
    # placement fits 80 GiB per rank without activation recomputation.
    return autopar.plan(model, mesh, (torch.zeros(16, 8192, dtype=torch.long),), loss_fn=cross_entropy_loss,
                        config=cfg)


@pytest.mark.slow
def test_llama3_70b_on_8x8_gets_tensor_parallel_mlp_and_qkv_and_recomputes_to_fit_80gb():
    p = _plan_70b(80)
    assert p.recomputed_stacks() == ["layers"] and "ac" in p.techniques, p.recompute
    assert p.recompute["layers"]["by"] == "solver" and p.recompute["layers"]["saved_bytes"] > 10 * 2**30
    pl = p.param_placements()
    assert len(pl) == 2 + 80 * 9 + 1
    for name in ("feed_forward.w1", "feed_forward.w2", "feed_forward.w3", "attention.wq", "attention.wk",
                 "attention.wv"):
        tp = pl[f"layers.7.{name}.weight"][1]
        assert isinstance(tp, Shard), (name, pl[f"layers.7.{name}.weight"])
    assert p.peak_memory_per_rank <= 80 * 2**30
    assert {"tp", "fsdp"} <= p.techniques


@pytest.mark.slow
def test_a_plan_that_fits_with_its_own_gradient_buckets_is_not_solved_for_again(monkeypatch):
    """Llama-3-8B on 8x8 H100 at 80 GiB: the program sets one 25 MiB bucket aside for the gradient buffers, and
    the plan it finds reduces gradients alone that take more. That plan fits the limit with them, so it is
    the plan: one solve, not a second with its buffers set aside."""
    from autopar.passes import solve_placements

    calls = []
    solve = solve_placements.solve_bounded
    monkeypatch.setattr(solve_placements, "solve_bounded", lambda *a, **k: calls.append(1) or solve(*a, **k))
    with torch.device("meta"):
        model = Llama(LLAMA3_8B)
    cfg = autopar.Config(device="h100", links={"dp": "ib", "tp": "nvlink"}, memory_limit_gb=80, solver=QUIET)
    p = autopar.plan(model, autopar.fake_mesh((8, 8), ("dp", "tp")), (torch.zeros(16, 8192, dtype=torch.long),),
                     loss_fn=cross_entropy_loss, config=cfg)
    assert p.memory_breakdown["grad_buckets"] > 25 * 2**20  # more than the bucket set aside
    assert p.peak_memory_per_rank <= 80 * 2**30
    assert len(calls) == 1


@pytest.mark.slow
def test_a_plan_passed_over_for_one_over_the_limit_is_solved_from_not_the_least_peak(monkeypatch):
    """Llama-3-8B on 8x8 H100, 16 sequences, at 26.5 GiB (2% above its smallest peak): where the program setting
    the gradient buckets aside has no plan, but a plan its solve passed over for a faster one (a quiet-axis
    alternative's, or the plan it was an alternative to) fits with its own buckets (`_solve_one`'s
    ProgramInfeasible carries it as `fitting`), the fastest plan with as much set aside is solved from that plan,
    and the verdict's search for a plan of least peak is not run. Real solves meet this only at knife-edge limits
    that move with any change to the cost or memory model, so the error is injected here, carrying the plan a
    first planning call found."""
    from autopar.passes import solve_placements
    from autopar.solver.ilp import ProgramInfeasible

    def plan():
        with torch.device("meta"):
            model = Llama(LLAMA3_8B)
        cfg = autopar.Config(device="h100", links={"dp": "ib", "tp": "nvlink"}, memory_limit_gb=26.5, solver=QUIET)
        return autopar.plan(model, autopar.fake_mesh((8, 8), ("dp", "tp")), (torch.zeros(16, 8192, dtype=torch.long),),
                            loss_fn=cross_entropy_loss, config=cfg)

    solve_one = solve_placements._solve_one
    found = []

    def record(ctx, *a, **k):
        out = solve_one(ctx, *a, **k)
        found.append((dict(ctx.choice), dict(out[4])))
        return out

    monkeypatch.setattr(solve_placements, "_solve_one", record)
    plan()
    fitting = found[-1]
    starts = []

    def passed_over(ctx, *a, **k):
        starts.append(k.get("start"))
        if len(starts) == 1:
            e = ProgramInfeasible("the gradient buffers of every plan found take more than the limit leaves them")
            e.fitting = fitting
            raise e
        return solve_one(ctx, *a, **k)

    monkeypatch.setattr(solve_placements, "_solve_one", passed_over)
    monkeypatch.setattr(solve_placements, "_smallest", lambda ctx: pytest.fail("searched for the least peak"))
    p = plan()
    assert len(starts) == 2 and starts[0] is None and starts[1] == fitting[0]
    assert p.peak_memory_per_rank <= 26.5 * 2**30


@pytest.mark.slow
def test_a_plan_over_the_limit_with_its_own_gradient_buckets_gets_no_quiet_axis_alternatives(monkeypatch):
    """Llama-3-70B on 8x8 H100, 8 sequences, at 26.5 GiB, below its smallest peak (26.64 GiB): the limit is
    refused, and no program keeping an axis quiet is solved for a plan that does not fit."""
    from autopar.solver import bounded

    quiet = []
    solve = bounded._solve
    monkeypatch.setattr(bounded, "_solve", lambda p, *a, **k: quiet.append(bool(p.quiet_axes)) or solve(p, *a, **k))
    with torch.device("meta"):
        model = Llama(LLAMA3_70B)
    cfg = autopar.Config(device="h100", links={"dp": "ib", "tp": "nvlink"}, memory_limit_gb=26.5, solver=QUIET)
    with pytest.raises(autopar.InfeasibleMemoryError, match=r"smallest plan found .*needs 26\.\d\d GiB"):
        autopar.plan(model, autopar.fake_mesh((8, 8), ("dp", "tp")), (torch.zeros(8, 8192, dtype=torch.long),),
                     loss_fn=cross_entropy_loss, config=cfg)
    assert quiet and not any(quiet), quiet


@pytest.mark.slow
def test_llama3_70b_infeasible_verdict_is_not_inflated_by_gradient_buffers():
    """Llama-3-70B on 8x8 H100, 8 sequences: at 26.5 GiB no plan fits. A plan of least memory rows may reduce
    several gradients alone (their inputs live to the end of the backward, beyond the rows); the verdict names
    the smallest peak of a plan whose buffers are counted, and 1% below that figure no plan fits either."""
    def plan(limit_gb: float):
        with torch.device("meta"):
            model = Llama(LLAMA3_70B)
        cfg = autopar.Config(device="h100", links={"dp": "ib", "tp": "nvlink"}, memory_limit_gb=limit_gb,
                             solver=QUIET)
        return autopar.plan(model, autopar.fake_mesh((8, 8), ("dp", "tp")), (torch.zeros(8, 8192, dtype=torch.long),),
                            loss_fn=cross_entropy_loss, config=cfg)

    with pytest.raises(autopar.InfeasibleMemoryError, match=r"smallest plan found .*needs [\d.]+ GiB") as e:
        plan(26.5)
    assert "gradient buckets" not in str(e.value)
    with pytest.raises(autopar.InfeasibleMemoryError):
        plan(0.99 * e.value.smallest_peak / 2**30)


@pytest.mark.slow
def test_llama3_70b_with_memory_unbounded_recomputes_nothing():
    p = _plan_70b(1e6)
    assert p.recompute["layers"]["variant"] == "keep" and "ac" not in p.techniques
    assert p.peak_memory_per_rank > 80 * 2**30  # what recomputation saves in the bounded plan


@pytest.mark.slow
def test_template_capture_gives_the_full_graph_plan():
    cfg = dataclasses.replace(LLAMA_SMALL, n_layers=4, dim=512, ffn_dim=2048, n_heads=8, n_kv_heads=4)
    with torch.device("meta"):
        model = Llama(cfg)
    mesh = autopar.fake_mesh((2, 4), ("dp", "tp"))
    tokens = torch.zeros(8, 256, dtype=torch.long)
    comps = [compile_plan(model, mesh, (tokens,), loss_fn=cross_entropy_loss,
                          config=autopar.Config(device="h100", template_layers=k, solver=QUIET))
             for k in (2, None)]
    assert [(x.count, x.captured) for x in comps[0].captured.blocks] == [(4, 2)]
    assert [(x.count, x.captured) for x in comps[1].captured.blocks] == [(4, 4)]
    a, b = (c.plan for c in comps)
    assert a.fingerprint == b.fingerprint
    assert a.params == b.params
    assert {k: (v.outs, v.count) for k, v in a.nodes.items()} == {k: (v.outs, v.count) for k, v in b.nodes.items()}
    # Costs, and activations kept from forward into backward, scale from 2 layers to 4; so do the gradients,
    # from where a captured layer produces them. The simulated step agrees to 2% (its schedule overlaps a
    # template's scaled layers a little differently); peak memory to 1%: this one peaks late in the backward,
    # where a captured layer's gradients count twice from its own backward on, while the whole model's come a
    # layer at a time (at most one layer's gradients apart).
    assert a.estimated_step_time == pytest.approx(b.estimated_step_time, rel=0.02)
    assert a.peak_memory_per_rank == pytest.approx(b.peak_memory_per_rank, rel=1e-2)
    assert {k: a.memory_breakdown[k] for k in ("params", "optimizer", "grad_buckets")} == \
        {k: b.memory_breakdown[k] for k in ("params", "optimizer", "grad_buckets")}


@pytest.mark.slow
def test_a_stack_whose_first_layer_differs_shares_one_plan_among_the_others():
    """T5's first layer of each stack holds the relative position bias the others reuse: the others form the
    repeated stack (keys `encoder.block.*`, counted twice), the first keeps its own keys, and the plan maps
    every parameter of the model, through a JSON round trip and the plan check of a capture made again."""
    from autopar.compiler import capture_step
    from autopar.plan_check import check_plan
    from autopar.testing.hf_models import t5

    model, args, kwargs = t5(batch=4, seq=16, layers=3)
    mesh = autopar.fake_mesh(2, "dp", device_type="cpu")
    cfg = autopar.Config(solver=QUIET, template_layers=None)
    comp = compile_plan(model, mesh, args, example_kwargs=kwargs, config=cfg)
    assert [(b.prefix, b.first, b.count) for b in comp.captured.blocks] == [("encoder.block", 1, 2),
                                                                            ("decoder.block", 1, 2)]
    p = comp.plan
    assert p.blocks == {"encoder.block": 2, "decoder.block": 2}
    assert p.block_first == {"encoder.block": 1, "decoder.block": 1}
    bias = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    assert bias in p.params and "encoder.block.*.layer.0.SelfAttention.q.weight" in p.params
    assert not [k for k in p.params if k.startswith(("encoder.block.1.", "decoder.block.2."))]
    assert p.key("encoder.block.0.layer.0.SelfAttention.q.weight") == "encoder.block.0.layer.0.SelfAttention.q.weight"
    assert p.key("decoder.block.2.layer.1.EncDecAttention.k.weight") == "decoder.block.*.layer.1.EncDecAttention.k.weight"
    assert set(p.param_placements()) == {n for n, _ in model.named_parameters()}
    tail = {k: n.count for k, n in p.nodes.items() if k.startswith("encoder.block.*.layer.0.SelfAttention.q/")}
    assert tail and set(tail.values()) == {2}, tail
    layers = tuple(f"{s}.block.{i}." for s in ("encoder", "decoder") for i in (1, 2))
    # Keyed per layer, alone: the add summing the position bias's gradient over the layers, which the last
    # layer lacks (its share comes first), so that layer's adds are numbered one lower.
    assert {k.split(".", 3)[3] for k in p.nodes if k.startswith(layers)} == {"layer.0.SelfAttention/bwd/add"}
    q = autopar.Plan.from_json(p.to_json())
    assert q.to_json() == p.to_json() and q.param_placements() == p.param_placements()
    check_plan(q, capture_step(model, mesh, args, kwargs, None, cfg, template_layers=None))


class _Layer(nn.Module):
    """One of a stack of alike layers (same parameters) whose forward may run one op more (a gate)."""

    def __init__(self, d: int, gated: bool):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.gated = gated

    def forward(self, x):
        h = self.fc(x)
        return x + (h * torch.sigmoid(h) if self.gated else F.gelu(h))


class _Stack(nn.Module):
    def __init__(self, d: int, gated: set[int], n: int = 4):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.layers = nn.ModuleList(_Layer(d, i in gated) for i in range(n))
        self.out = nn.Linear(d, d)

    def forward(self, x, y=None):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


@pytest.mark.parametrize("gated", [set(), {1, 2, 3}, {2, 3}, {0, 1}],
                         ids=["alike", "template-differs", "later-gain", "later-lack"])
def test_template_of_layers_that_differ_is_not_applied_to_them(gated):
    """Layers alike in parameters but not in ops: a template whose own layers differ falls back to the whole
    model with a warning; one that cannot see the difference (it lies past the template) is refused by the
    plan check at full depth, naming the op and template_layers=None. Alike layers keep the template."""
    from autopar.compiler import capture_step
    from autopar.errors import PlanMismatchError
    from autopar.plan_check import check_plan

    with torch.device("meta"):
        model = _Stack(64, gated)
    mesh = autopar.fake_mesh(2, "dp")
    inputs = (torch.zeros(16, 64), torch.zeros(16, 64))
    cfg = autopar.Config(device="h100", solver=QUIET)
    full = capture_step(model, mesh, inputs, None, mse, cfg, template_layers=None)
    if gated == {1, 2, 3}:
        with pytest.warns(UserWarning, match=r"fwd/(sigmoid|gelu).*template_layers=None"):
            comp = compile_plan(model, mesh, inputs, loss_fn=mse, config=cfg)
        assert comp.captured.blocks[0].captured == 4
        check_plan(comp.plan, full)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        comp = compile_plan(model, mesh, inputs, loss_fn=mse, config=cfg)
    p = comp.plan
    assert comp.captured.blocks[0].captured == 2
    if not gated:
        check_plan(p, full)
        return
    with pytest.raises(PlanMismatchError, match=r"layers\.\*/fwd/(sigmoid|gelu).*template_layers=None"):
        check_plan(p, full)
    check_plan(autopar.plan(model, mesh, inputs, loss_fn=mse, config=cfg.with_(template_layers=None)), full)


def _tiny_plan_json() -> str:
    with torch.device("meta"):
        model = Llama(dataclasses.replace(LLAMA_SMALL, n_layers=2))
    p = autopar.plan(model, autopar.fake_mesh((2, 2), ("dp", "tp")), (torch.zeros(4, 64, dtype=torch.long),),
                     loss_fn=cross_entropy_loss, config=autopar.Config(solver=QUIET))
    return p.to_json(timings=False)


@functools.lru_cache(maxsize=1)
def _tiny_plan_json_once() -> str:
    """_tiny_plan_json, planned once per process: for the tests that read the plan rather than plan it again."""
    return _tiny_plan_json()


@pytest.mark.slow
def test_plans_are_byte_identical_across_runs_and_processes():
    a = _tiny_plan_json_once()
    assert a == _tiny_plan_json()
    code = "import tests.test_planner as t, sys; sys.stdout.write(t._tiny_plan_json())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout == a


@pytest.mark.slow
def test_plan_json_round_trip_and_param_expansion():
    p = autopar.Plan.from_json(_tiny_plan_json_once())
    assert p.to_json() == _tiny_plan_json_once()
    fqns = set(p.param_placements())
    assert "layers.0.attention.wq.weight" in fqns and "layers.1.attention.wq.weight" in fqns
    assert all(len(lay) == 2 for lay in p.param_placements().values())
    d = json.loads(p.to_json())
    assert d["version"] == 1 and "seconds" not in json.dumps(d["solver"])


def test_pins_fix_parameters_and_the_rest_is_optimized():
    pins = {"layers.*.weight": (Replicate(),)}
    p = plan_mlp([2048, 32768, 2048], 16, autopar.fake_mesh(8, "tp"), device="h100", pins=pins)
    assert all(lay == (Replicate(),) for f, lay in p.param_placements().items() if f.endswith("weight"))


def test_infeasible_memory_names_minimum_and_consumers():
    # A 1 MiB limit: sizes are given in MiB, the unit that fits the limit.
    with pytest.raises(autopar.InfeasibleMemoryError,
                       match=r"limit of 1\.02 MiB per rank; the smallest plan found (with recomputation \(layers "
                             r"\w+\) )?needs [\d.]+ MiB "
                             r"\(largest consumers: .*layers"):
        plan_mlp([1024] * 4, 64, autopar.fake_mesh(4, "dp"), device="h100", memory_limit_gb=0.001)


def test_unknown_device_lists_known_ones():
    with pytest.raises(ValueError, match="known devices: a100, cpu, h100, h200"):
        plan_mlp([64, 64], 8, autopar.fake_mesh(2, "dp"), device="h900")


def test_indivisible_axis_excludes_shards_and_bad_pin_is_explained():
    p = plan_mlp([64, 96, 64], 6, autopar.fake_mesh(4, "dp"), device="h100")  # 6 rows do not split 4 ways
    with pytest.raises(ValueError, match=r"does not divide shape \[96, 64\] evenly"):
        plan_mlp([64, 96, 64], 6, autopar.fake_mesh(5, "dp"), device="h100",
                 pins={"layers.0.weight": (Shard(0),)})


def test_glob_activation_pin_skips_ops_it_does_not_divide_and_an_exact_one_is_explained():
    """A recipe's "every forward matmul on the local batch" pin meets a matmul without a batch dim (a table of
    one row): the glob skips it; the same pin naming that op exactly is an error that lists what is legal."""

    class Gate(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.Parameter(torch.randn(1, 8))
            self.proj, self.mix = nn.Linear(32, 32), nn.Linear(8, 32)

        def forward(self, x):
            return (self.proj(x) * self.mix(self.table)).sum()  # mix: a [1, 32] matmul, no batch to split

    mesh, x = autopar.fake_mesh(2, "dp"), torch.zeros(8, 32)
    batch = (Shard(0),)
    p = autopar.plan(Gate(), mesh, (x,), config=autopar.Config(solver=QUIET, pins={"act:*/fwd/*mm*": batch}))
    assert p.nodes["proj/fwd/addmm"].outs[0] == batch
    assert p.nodes["mix/fwd/addmm"].outs[0] != batch
    with pytest.raises(ValueError, match=r"pin 'act:mix/fwd/addmm': no legal strategy of mix/fwd/addmm outputs S\(0\)"):
        autopar.plan(Gate(), mesh, (x,), config=autopar.Config(solver=QUIET, pins={"act:mix/fwd/addmm": batch}))


def test_model_that_does_not_trace_names_module_and_line():
    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            h = self.lin(x)
            if h.sum() > 0:  # data-dependent control flow
                h = h * 2
            return h.sum()

    with pytest.raises(autopar.CaptureError, match=r"test_planner.py:\d+ in forward: if h.sum\(\) > 0"):
        autopar.plan(Bad(), autopar.fake_mesh(2, "dp"), (torch.zeros(4, 8),), config=autopar.Config(solver=QUIET))


def test_output_without_loss_asks_for_loss_fn():
    with pytest.raises(ValueError, match="pass loss_fn"):
        autopar.plan(nn.Linear(8, 8), autopar.fake_mesh(2, "dp"), (torch.zeros(4, 8),),
                     config=autopar.Config(solver=QUIET))


torch.library.define("autopar_test::scale", "(Tensor x) -> Tensor")


@torch.library.impl("autopar_test::scale", "CompositeExplicitAutograd")
def _scale(x):
    return x * 2


@torch.library.register_fake("autopar_test::scale")
def _scale_fake(x):
    return torch.empty_like(x)


def test_op_without_rule_warns_and_runs_replicated():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x):
            return torch.ops.autopar_test.scale(self.lin(x).detach()).sum() + self.lin(x).sum()

    with pytest.warns(UserWarning, match="no sharding rule for these ops.*autopar_test.scale"):
        p = autopar.plan(M(), autopar.fake_mesh(2, "dp"), (torch.zeros(8, 16),), config=autopar.Config(solver=QUIET))
    key = next(k for k in p.nodes if "scale" in k)
    assert p.nodes[key].outs == [(Replicate(),)]


def test_solver_time_limit_returns_best_plan_with_warning():
    with torch.device("meta"):
        model = Llama(dataclasses.replace(LLAMA_SMALL, n_layers=2, dim=1024, ffn_dim=4096))
    cfg = autopar.Config(device="h100", solver_time_limit_s=0.05, solver=QUIET)
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            p = autopar.plan(model, autopar.fake_mesh((2, 4), ("dp", "tp")), (torch.zeros(8, 256, dtype=torch.long),),
                             loss_fn=cross_entropy_loss, config=cfg)
        except ValueError as e:  # nothing feasible at all within the limit: the error says what to change
            assert "solver_time_limit_s" in str(e)
            return
    assert p.estimated_step_time > 0
    assert any("time limit" in str(w.message) for w in caught)


@pytest.mark.slow
def test_corrupt_or_foreign_plan_files_are_explained():
    good = json.loads(_tiny_plan_json_once())
    with pytest.raises(autopar.PlanMismatchError, match="not valid JSON"):
        autopar.Plan.from_json(_tiny_plan_json_once()[:100])
    with pytest.raises(autopar.PlanMismatchError, match="not an autopar plan file"):
        autopar.Plan.from_json(json.dumps({"hello": 1}))
    with pytest.raises(autopar.PlanMismatchError, match="version 0 is not supported.*re-plan"):
        autopar.Plan.from_json(json.dumps(dict(good, version=0)))
    broken = dict(good)
    del broken["params"]
    with pytest.raises(autopar.PlanMismatchError, match="corrupt or incomplete"):
        autopar.Plan.from_json(json.dumps(broken))
    bad_layout = dict(good, params={k: "S(x)" for k in good["params"]})
    with pytest.raises(autopar.PlanMismatchError, match="corrupt or incomplete.*cannot parse placement"):
        autopar.Plan.from_json(json.dumps(bad_layout))


@pytest.mark.slow
def test_cp_sat_backend_reaches_the_same_optimum_as_highs():
    objectives = []
    for backend in ("highs", "cp-sat"):
        solver = autopar.SolverConfig(show_progress=False, backend=backend)
        with torch.device("meta"):
            model = MLP([256, 1024, 256])
        p = autopar.plan(model, autopar.fake_mesh((2, 2), ("dp", "tp")), (torch.zeros(64, 256), torch.zeros(64, 256)),
                         loss_fn=mse, config=autopar.Config(device="h100", solver=solver))
        assert p.solver_stats["optimal"]
        objectives.append(p.solver_stats["objective_s"])
    assert objectives[1] == pytest.approx(objectives[0], rel=1e-3, abs=1e-8)


@pytest.mark.slow
def test_solver_plan_is_no_slower_than_ddp_when_gradient_reductions_hide():
    """On 2x2 CPU ranks the small Llama trains fastest data-parallel, with the gradient all-reduce behind the
    backward; pricing that all-reduce as exposed made the solver prefer tensor parallelism."""
    from autopar import recipes

    with torch.device("meta"):
        model = Llama(LLAMA_SMALL)
    tokens = torch.zeros(8, 32, dtype=torch.long)
    mesh = autopar.fake_mesh((2, 2), ("dp", "tp"), device_type="cpu")
    cfg = autopar.Config(solver=QUIET)
    comp = compile_plan(model, mesh, (tokens,), loss_fn=cross_entropy_loss, config=cfg)
    p = comp.plan
    ddp = recipes.plan_recipe("ddp", model, mesh, (tokens,), loss_fn=cross_entropy_loss, config=cfg)
    assert p.estimated_step_time <= ddp.estimated_step_time * 1.001, (p.techniques, p.estimated_step_time,
                                                                        ddp.estimated_step_time)
    # Data parallel over both axes: each gradient bucket is reduced once over the flattened (dp, tp) group, or
    # where a rank has no such group, over one axis then the other (two collectives per bucket, not two per
    # parameter); the 10.6 MB of gradients make two DDP-sized buckets.
    import dataclasses

    from autopar.codegen import RankSpec, collectives

    rank = RankSpec.fake(("dp", "tp"), (2, 2), (1, 0))
    assert all(lay == (Replicate(), Replicate()) for lay in p.param_placements().values())
    # (The solver may also move an activation where the simulator finds that faster: only the reductions count.)
    bwd = collectives(comp.program(rank).backward, rank)
    assert sorted(c for c in bwd if c[0] == "all_reduce") == [("all_reduce", "dp+tp")] * 2, bwd
    per_axis = dataclasses.replace(rank, flat_groups=())
    bwd = collectives(comp.program(per_axis).backward, per_axis)
    reductions = sorted(c for c in bwd if c[0] == "all_reduce")
    assert reductions == [("all_reduce", "dp")] * 2 + [("all_reduce", "tp")] * 2, bwd


def _ddp_mlp(dims, pins=None):
    """An MLP under the DDP recipe (batch 16 split over 4 CPU ranks), with extra activation pins."""
    from autopar import recipes
    from autopar.mesh import mesh_spec

    with torch.device("meta"):
        model = MLP(dims)
    mesh = autopar.fake_mesh(4, "dp", device_type="cpu")
    shapes = {k: tuple(p.shape) for k, p in model.named_parameters()}
    r = recipes.ddp(shapes, mesh_spec(mesh, None, "cpu"), n_inputs=2)
    r["pins"].update(pins or {})
    x, y = torch.zeros(16, dims[0]), torch.zeros(16, dims[-1])
    return compile_plan(model, mesh, (x, y), loss_fn=mse, config=autopar.Config(solver=QUIET, **r))


def test_the_simulator_gathers_parameters_in_codegens_buckets_and_order():
    """FSDP's parameter all-gathers in the step simulator are codegen's: one bucket per layer (and mesh axis and
    dtype), the same members in the same order; in the forward the next layer's bucket gathers while this layer
    computes (codegen issues it when it waits on this one), in the backward a layer's bucket is gathered whole at
    its first use, ahead of that layer's gradient reductions (which queue behind it on the axis)."""
    from autopar.codegen import RankSpec
    from autopar.codegen.collectives import BUCKET_META
    from autopar.models.llama import LLAMA_TINY
    from autopar.passes.simulate_step import _param_gathers

    with torch.device("meta"):
        model = Llama(LLAMA_TINY)
    config = autopar.Config(solver=QUIET, device="h100", pins={"*": (Shard(0),)},
                            input_placements={0: (Shard(0),)})
    comp = compile_plan(model, autopar.fake_mesh(4, "dp"), (torch.zeros(8, 16, dtype=torch.long),),
                        loss_fn=cross_entropy_loss, config=config)
    prog = comp.program(RankSpec.fake(("dp",), (4,), (1,)))
    emitted = [n.meta[BUCKET_META] for n in prog.forward.graph.nodes if BUCKET_META in n.meta
               and "all_gather" in str(n.target)]
    simulated = [tuple(c[-1].split("/", 1)[1] for c in g.comms) for g in _param_gathers(comp.ctx).groups if g.bucket]
    assert len(emitted) > LLAMA_TINY.n_layers and simulated == emitted, (simulated, emitted)

    timeline = comp.ctx.simulation.timeline
    gathers: dict[str, list[tuple[float, float]]] = {}
    for stream, label, begin, end in timeline:
        if stream == "comm:dp" and label.startswith("gather param/"):
            gathers.setdefault(label.split("/", 1)[1], []).append((begin, end))
    layers = [b for b in emitted if b[0].startswith("layers.")]
    assert all(len(gathers[f]) == 2 for bucket in layers for f in bucket)  # forward, and again in backward
    compute = [(label, begin, end) for stream, label, begin, end in timeline if stream == "compute"]
    layer0_fwd_end = max(end for label, _, end in compute if label.startswith("layers.0.") and "/fwd/" in label)
    assert min(gathers[f][0][0] for b in layers if b[0].startswith("layers.1.") for f in b) < layer0_fwd_end
    for bucket in layers:
        bwd = sorted(gathers[f][1] for f in bucket)
        assert all(b == pytest.approx(e, abs=1e-12) for (_, e), (b, _) in zip(bwd, bwd[1:]))  # one collective
        layer = bucket[0].split(".")[1]
        first_grad = min(begin for stream, label, begin, _ in timeline
                         if stream == "comm:dp" and label.startswith(f"grad layers.{layer}."))
        assert bwd[-1][1] <= first_grad


def test_simulated_waits_count_blocking_collectives_behind_their_axis_not_queued_gradient_reductions():
    """Simulation.waits_by_axis: per mesh axis, the time blocking collectives (layout changes the compute waits
    for) spend waiting for the axis, from when their input is ready to when they start. Gradient reductions
    queued behind each other are not waits (they are bucketed and run beside the backward)."""
    def entries(sim, stream):
        return [(label, begin, end) for s, label, begin, end in sim.timeline if s == stream]

    # Data parallel alone: the reductions run back to back on the axis, and nothing blocking waits.
    sim = _ddp_mlp([256, 1024, 256]).ctx.simulation
    grads = entries(sim, "comm:dp")
    assert grads and all(label.startswith("grad ") for label, _, _ in grads), grads
    assert any(b == pytest.approx(prev_end, abs=1e-12) for (_, _, prev_end), (_, b, _) in zip(grads, grads[1:]))
    assert sim.waits_by_axis == {}

    # The middle layer's weight gradient computed replicated: both its inputs (the transposed output gradient and
    # the forward activation) are gathered over dp, behind the last layer's gradient reduction, one after the other.
    sim = _ddp_mlp([256, 1024, 1024, 256], {"act:layers.1/bwd/mm#1": (Replicate(),)}).ctx.simulation
    comm = entries(sim, "comm:dp")
    compute = {label: end for label, _, end in entries(sim, "compute")}
    moves = [(b, e) for label, b, e in comm if label == "layers.1/bwd/mm#1"]
    grad_end = next(e for label, _, e in comm if label == "grad layers.2.weight")
    assert len(moves) == 2 and moves[0][0] == pytest.approx(grad_end) and moves[1][0] == pytest.approx(moves[0][1])
    # The transpose (no compute time) is ready when the op before it on the compute stream ends; the activation
    # when the forward GELU ends.
    ready = [compute["layers.1/bwd/mm"], compute["root/fwd/gelu"]]
    expected = sum(begin - r for (begin, _), r in zip(moves, ready))
    assert expected > 0
    assert sim.waits_by_axis == {0: pytest.approx(expected, rel=1e-9)}


class _InputViewGrad(nn.Module):
    """`p`'s gradient is the loss's seed broadcast (a view of a graph input): no allocation of the step holds it."""

    def __init__(self):
        super().__init__()
        self.w = nn.Linear(16, 16)
        self.p = nn.Parameter(torch.zeros(8, 16))

    def forward(self, x):
        return self.w(x) + self.p


def test_a_gradient_without_an_allocation_of_its_own_stays_in_the_static_state():
    """Gradients count where the backward produces them; one the memory profile finds no allocation for counts
    over the whole step, at its size in the parameter's layout, and the breakdown's gradients include it."""
    from autopar.passes.memory_profile import memory_profile

    comp = compile_plan(_InputViewGrad(), autopar.fake_mesh((2,), ("dp",), "cpu"), (torch.randn(8, 16),),
                        loss_fn=lambda y, x: y.sum(), config=autopar.Config(solver=QUIET))
    ctx = comp.ctx
    prof = memory_profile(ctx)
    assert "param/w.weight#grad" in prof.term_key and "param/p#grad" not in prof.term_key
    shard = 2 if ctx.strategies["param/p"][ctx.choice["param/p"]].outs[0][0] != Replicate() else 1
    held = {k: float(v[ctx.choice[k]]) for k, v in prof.static_grads.items()}
    assert held == {"param/p": 8 * 16 * 4 / shard, "param/w.weight": 0.0, "param/w.bias": 0.0}
    assert comp.plan.memory_breakdown["grads"] >= held["param/p"]


@pytest.mark.slow
def test_a_limit_above_the_smallest_peak_is_not_given_the_plan_of_least_peak():
    """The example Llama on 2x2 at 0.35x of its unconstrained peak, recomputation off (the same path in less
    time): the plan of least peak (which ignores time) fits, but a plan within a few percent of the bound is
    found and kept (the plan of least peak took 589 ms per step, a gap of 79%; the plan kept 159 ms, found by the
    warm starts since parameters may be sharded over both axes and a start plan survives the dominance
    reduction, where before it took the program whose rows hold the gradient buffers at an upper bound to find
    one of 175 ms)."""
    torch.manual_seed(0)
    limit = 20.23 * 2**20  # 0.35x of the unconstrained plan's 57.80 MiB
    plan = autopar.plan(Llama(LLAMA_SMALL), autopar.fake_mesh((2, 2), ("dp", "tp"), "cpu"),
                        (torch.zeros(8, 32, dtype=torch.long),), loss_fn=cross_entropy_loss,
                        config=autopar.Config(solver=QUIET, memory_limit_gb=limit / 2**30, recompute="off"))
    s = plan.solver_stats
    assert plan.peak_memory_per_rank <= limit
    assert s["path"] != "plan of least peak" and s["gap"] < 0.15, s


def test_the_memory_breakdown_counts_the_buffers_the_step_reads():
    """The example Llama's rotary tables are module buffers: the plan's peak counts their bytes in their planned
    layouts, as the parameters' (a step's measured peak holds them; without them a tight plan measured 0.35% over
    its peak)."""
    torch.manual_seed(0)
    model = Llama(LLAMA_SMALL)
    mesh = autopar.fake_mesh((2, 2), ("dp", "tp"), "cpu")
    p = autopar.plan(model, mesh, (torch.zeros(8, 32, dtype=torch.long),), loss_fn=cross_entropy_loss,
                     config=autopar.Config(solver=QUIET))
    want = 0.0
    for name, b in model.named_buffers():
        layout = p.nodes[f"buffer/{name}"].outs[0]
        want += b.numel() * b.element_size() / math.prod(2 for q in layout if isinstance(q, Shard))
    assert want > 0 and p.memory_breakdown["buffers"] == int(want), (p.memory_breakdown, want)
    assert sum(p.memory_breakdown.values()) == p.peak_memory_per_rank



def test_the_input_batch_counts_as_the_rank_holds_it():
    """The runtime moves the rank's shard of the global batch to the device: on a GPU mesh the plan counts that
    shard (8 x 64 int64 tokens over dp=8: 512 bytes), on a CPU mesh the caller's whole batch, of which a dim-0
    shard is a view (4096 bytes); both in the peak, whatever the plan's input layout."""
    from autopar import recipes
    from autopar.mesh import MeshSpec
    from autopar.models.llama import LLAMA_TINY

    tokens = torch.zeros(8, 64, dtype=torch.long)
    with torch.device("meta"):
        model = Llama(LLAMA_TINY)
    shapes = {k: tuple(p.shape) for k, p in model.named_parameters()}
    ddp = recipes.recipe("ddp")(shapes, MeshSpec(("dp",), (8,), ("nvlink",), "cuda"), n_inputs=1)
    gpu = autopar.plan(model, autopar.fake_mesh((8,), ("dp",)), (tokens,), loss_fn=cross_entropy_loss,
                       config=autopar.Config(device="h100", solver=QUIET, **ddp))
    assert gpu.inputs == [(Shard(0),)] and gpu.memory_breakdown["inputs"] == 512
    cpu = autopar.plan(Llama(LLAMA_TINY), autopar.fake_mesh((2, 2), ("dp", "tp"), "cpu"), (tokens,),
                       loss_fn=cross_entropy_loss, config=autopar.Config(solver=QUIET))
    assert cpu.memory_breakdown["inputs"] == 4096
    assert sum(cpu.memory_breakdown.values()) == cpu.peak_memory_per_rank
