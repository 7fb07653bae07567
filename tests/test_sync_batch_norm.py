"""Training batch norm written as sums (autopar/rules/sync_batch_norm.py): equal to the fused kernels, every op
checked against execution with a batch-sharded input, and planned with per-channel all-reduces where the fused
kernel would have to gather the batch."""
from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

import autopar
from autopar import capture as capture_module
from autopar.rules import axis_strategies, fmt_strategy, op_info
from autopar.rules.sync_batch_norm import batch_norm_backward, batch_norm_training
from autopar.testing import rule_check
from test_rules_vision import small_cnn

aten = torch.ops.aten
F64 = torch.float64


@pytest.mark.parametrize("affine,stats", [(True, True), (False, True), (True, False)])
def test_decomposition_matches_the_fused_kernels(affine, stats):
    torch.manual_seed(0)
    x = torch.randn(6, 4, 5, 3, dtype=F64) * 2 + 100  # a mean far above the spread: no cancellation allowed
    w, b = (torch.randn(4, dtype=F64), torch.randn(4, dtype=F64)) if affine else (None, None)
    rm, rv = (torch.randn(4, dtype=F64), torch.rand(4, dtype=F64) + 0.5) if stats else (None, None)
    if stats:
        want = aten._native_batch_norm_legit_functional.default(x, w, b, rm, rv, True, 0.1, 1e-5)
    else:
        want = aten._native_batch_norm_legit.no_stats(x, w, b, True, 0.1, 1e-5)
    got = batch_norm_training(x, w, b, rm, rv, 0.1, 1e-5)[:len(want)]
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(x)
    mask = [True, affine, affine]
    want = aten.native_batch_norm_backward.default(grad, x, w, rm, rv, want[1], want[2], True, 1e-5, mask)
    got = batch_norm_backward(grad, x, w, got[1], got[2], mask)
    for g, r in zip(got, want):
        assert (g is None) == (r is None)
        if r is not None:
            torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-10)


def test_decomposed_batch_norm_rules_match_execution_on_a_sharded_batch():
    torch.manual_seed(0)
    model, args = small_cnn(), (torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,)))
    cap = capture_module.capture(model, args, batch_norm_sums=True)
    targets = {n.target for n in cap.compute_nodes()}
    assert not targets & {aten._native_batch_norm_legit_functional.default, aten.native_batch_norm_backward.default}
    stats = next(n for n in cap.compute_nodes() if n.target is aten.sum.dim_IntList and list(n.args[1]) == [0, 2, 3])
    assert "S(0) -> P" in [fmt_strategy(s) for s in axis_strategies(op_info(stats))[0]]
    assert not rule_check.ops_without_rules(cap)
    calls = rule_check.record_calls(cap.gm, rule_check.placeholder_values(cap, model, args))
    errors = rule_check.check_graph(cap.gm, calls, 2) + rule_check.check_graph(cap.gm, calls, 4)
    assert not errors, "\n".join(errors[:20])


def _plan_batch_sharded_convolutions(sync_batch_norm: bool):
    """Data parallelism forced on the convolutions of a CNN whose activations are large (8 MiB each): the plan
    and the captured graph it was made on."""
    from autopar.compiler import compile_plan

    torch.manual_seed(0)
    model, args = small_cnn(32), (torch.randn(256, 3, 32, 32), torch.randint(0, 10, (256,)))
    pins = {"*": (Replicate(),), "act:*/fwd/convolution": (Shard(0),)}
    cfg = autopar.Config(device="h100", pins=pins, input_placements={0: (Shard(0),), 1: (Shard(0),)},
                         sync_batch_norm=sync_batch_norm, solver=autopar.SolverConfig(show_progress=False))
    comp = compile_plan(model, autopar.fake_mesh((4,), ("dp",)), args, config=cfg, template_layers=None)
    return comp.plan, comp.captured


def test_fused_batch_norm_gathers_the_batch_where_the_decomposition_reduces_statistics():
    fused, _ = _plan_batch_sharded_convolutions(sync_batch_norm=False)
    into_bn = [t for t in fused.transitions if t.dst == "body.1/fwd/_native_batch_norm_legit_functional"]
    assert [t.steps for t in into_bn] == ["all_gather[dp] dim 0"]

    plan, cap = _plan_batch_sharded_convolutions(sync_batch_norm=True)
    mean = plan.nodes["body.1/fwd/sum"]
    assert (mean.ins, mean.outs) == ([(Shard(0),)], [(Partial(),)])  # the first statistic, summed per rank
    reductions = [t for t in plan.transitions if t.kind == "activation" and t.src.startswith("body.1/")]
    assert reductions and all(t.steps == "all_reduce[dp]" for t in reductions)
    for t in reductions:  # each moves one value per channel
        assert cap.nodes[t.src].meta["val"].numel() == 32, t
