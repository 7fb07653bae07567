"""Dropout under sharding: its rules, and the masks ranks draw (autopar/codegen/rng.py).

Ranks holding the same shard of a dropout's input (replicas over an axis where it is Replicate or Partial)
must draw the same mask bit for bit, ranks holding different shards independent ones; the same seed must
give the same masks run to run. The execution test rebuilds the global masks from what each rank saved for
backward and checks that a single-device run with exactly those masks computes the same losses, gradients
and weights as the parallel run.
"""
from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard

import autopar
from autopar.codegen import RankSpec
from autopar.compiler import compile_plan
from autopar.codegen.rng import SEEDED_DROPOUT, dropout_scale, shard_index, stream_key
from autopar.config import Config, SolverConfig
from autopar.plan import Plan
from autopar.rules import axis_strategies, fmt_strategy, op_info
from autopar.runtime.state import local_shard
from autopar.testing import rule_check
from autopar.testing.compare import assert_all_close, grad_pairs, update_pairs
from autopar.testing.dist import get_pool

aten = torch.ops.aten
QUIET = SolverConfig(show_progress=False)
NAMES, SHAPE = ("dp", "tp"), (2, 2)
P_DROP = 0.5
STEPS = 2
LR = 1e-2
DROPS = ("drop1/fwd/native_dropout", "drop2/fwd/native_dropout", "drop3/fwd/native_dropout")


# --- rules ----------------------------------------------------------------------------------------------------
def _strategies(target, args):
    out = target(*args)
    info = rule_check.info_of(target, args, {}, list(out) if isinstance(out, tuple) else [out])
    got, known = axis_strategies(info)
    assert known, target
    return [fmt_strategy(s) for s in got]


def test_dropout_rules():
    x = torch.randn(4, 6)
    assert _strategies(aten.native_dropout.default, (x, 0.5, True)) == [
        "R -> R,R", "S(0) -> S(0),S(0)", "S(1) -> S(1),S(1)", "P -> P,R", "P(avg) -> P(avg),R"]
    got = _strategies(aten.native_dropout_backward.default, (x, x > 0, 2.0))
    assert got[:3] == ["R,R -> R", "S(0),S(0) -> S(0)", "S(1),S(1) -> S(1)"] and "P,R -> P" in got


def _split(t: torch.Tensor, p, n: int, gen: torch.Generator) -> list[torch.Tensor]:
    if isinstance(p, Shard):
        return [c.contiguous() for c in t.chunk(n, p.dim)]
    if isinstance(p, Partial):
        total = t * n if p.reduce_op == "avg" else t
        parts = [torch.randn(t.shape, generator=gen, dtype=t.dtype) for _ in range(n - 1)]
        return parts + [total - sum(parts)]
    return [t] * n


@pytest.mark.parametrize("n", [2, 4])
def test_dropout_rules_hold_for_seeded_masks(n):
    """p > 0: each simulated rank draws its mask as the generated program does (shard index of its piece on
    this axis). Every strategy must reassemble to x * mask * scale with ONE global mask: replicated masks
    agree, the parts of a Partial input are masked alike, and shards draw different masks."""
    x = torch.randn(8, 12, dtype=torch.float64)
    p, key, seed = 0.3, stream_key("layer/fwd/native_dropout"), 1234
    args = (x, p, True)
    info = rule_check.info_of(aten.native_dropout.default, args, {}, list(aten.native_dropout.default(*args)))
    gen = torch.Generator().manual_seed(0)
    for s in axis_strategies(info)[0]:
        pieces = _split(x, s.ins[0], n, gen)
        outs, masks = zip(*(SEEDED_DROPOUT(pieces[r], p, seed, key, shard_index(s.ins, (r,), (n,)))
                            for r in range(n)))
        what = fmt_strategy(s)
        if isinstance(s.outs[1], Shard):
            mask = torch.cat(masks, s.outs[1].dim)
            assert all(not torch.equal(masks[0], m) for m in masks[1:]), f"{what}: shards drew the same mask"
        else:
            assert all(torch.equal(masks[0], m) for m in masks[1:]), f"{what}: replicas drew different masks"
            mask = masks[0]
        if isinstance(s.outs[0], Shard):
            out = torch.cat(outs, s.outs[0].dim)
        elif isinstance(s.outs[0], Partial):
            out = sum(outs[1:], outs[0]) / (n if s.outs[0].reduce_op == "avg" else 1)
        else:
            out = outs[0]
        torch.testing.assert_close(out, x * mask * dropout_scale(p), msg=what)
        assert 0.5 < mask.double().mean() < 0.9, what


def test_seeded_dropout_matches_native_dropout_semantics():
    x = torch.randn(64, 64)
    out, mask = SEEDED_DROPOUT(x, 0.25, 1, 2, 3)
    assert mask.dtype == torch.bool and torch.equal(out, x * mask * (1 / 0.75))
    again = SEEDED_DROPOUT(x.to(torch.bfloat16), 0.25, 1, 2, 3)[1]
    assert torch.equal(mask, again)  # the mask depends on the seeds, not on the dtype
    assert not torch.equal(mask, SEEDED_DROPOUT(x, 0.25, 1, 2, 4)[1])
    assert not torch.equal(mask, SEEDED_DROPOUT(x, 0.25, 1, 5, 3)[1])
    assert not torch.equal(mask, SEEDED_DROPOUT(x, 0.25, 6, 2, 3)[1])
    zero, none = SEEDED_DROPOUT(x, 1.0, 1, 2, 3)
    assert not zero.any() and not none.any()
    xg = x.clone().requires_grad_()
    out, mask = SEEDED_DROPOUT(xg, 0.25, 1, 2, 3)
    out.sum().backward()
    torch.testing.assert_close(xg.grad, mask * (1 / 0.75))


# --- the model, planned in this process ------------------------------------------------------------------
class DropMLP(nn.Module):
    """Dropout on a tensor-parallel hidden layer (sharded over tp), then twice on the row-parallel output:
    before its all-reduce (Partial over tp) and after it (replicated over tp)."""

    def __init__(self, d_in: int = 32, hidden: int = 64, d_out: int = 32, p: float = P_DROP):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.drop1 = nn.Dropout(p)
        self.fc2 = nn.Linear(hidden, d_out)
        self.drop2 = nn.Dropout(p)
        self.drop3 = nn.Dropout(p)

    def forward(self, x, y):
        return self.drop3(self.drop2(self.fc2(self.drop1(F.silu(self.fc1(x))))))


class FixedMask(nn.Module):
    """Dropout with a given mask (the reference run)."""

    def __init__(self, p: float):
        super().__init__()
        self.scale, self.mask = dropout_scale(p), None

    def forward(self, x):
        return x * self.mask * self.scale


def mse(out, x, y):
    return ((out - y) ** 2).mean()


def build():
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    return DropMLP(), (torch.randn(16, 32, generator=gen), torch.randn(16, 32, generator=gen))


def _lay(**axes):
    return tuple(axes.get(a, Replicate()) for a in NAMES)


@functools.lru_cache(maxsize=None)
def planned():
    """FSDP x Megatron: weights sharded over dp, fc1 column- and fc2 row-parallel over tp, the batch over dp;
    the dropouts pinned to the three cases over tp (Shard, Partial, Replicate)."""
    pins = {"fc1.weight": _lay(dp=Shard(0), tp=Shard(0)), "fc1.bias": _lay(dp=Shard(0), tp=Shard(0)),
            "fc2.weight": _lay(dp=Shard(0), tp=Shard(1)), "*": _lay(dp=Shard(0)),
            f"act:{DROPS[0]}": _lay(dp=Shard(0), tp=Shard(1)), f"act:{DROPS[1]}": _lay(dp=Shard(0), tp=Partial()),
            f"act:{DROPS[2]}": _lay(dp=Shard(0))}
    config = Config(solver=QUIET, pins=pins, input_placements={0: _lay(dp=Shard(0)), 1: _lay(dp=Shard(0))})
    model, inputs = build()
    return compile_plan(model, autopar.fake_mesh(SHAPE, NAMES, "cpu"), inputs, loss_fn=mse, config=config)


def plan_json() -> str:
    return planned().plan.to_json()


def _drop_layouts(plan: Plan) -> dict[str, tuple]:
    return {name: tuple(plan.nodes[name].ins[0]) for name in DROPS}


def test_generated_program_seeds_masks_by_shard():
    """Every rank's program draws each mask from (step seed, node key, shard index): equal on the tp ranks for
    the output dropout, different across dp and, for the hidden one, across tp; the masks are saved."""
    comp = planned()
    plan = comp.plan
    calls = {}
    for coords in [(0, 0), (0, 1), (1, 0), (1, 1)]:
        prog = comp.program(RankSpec.fake(NAMES, SHAPE, coords))
        assert prog.takes_seed and "native_dropout.default" not in prog.forward.code
        assert list(prog.forward.graph.nodes)[len(prog.params) + len(prog.buffers) + len(prog.inputs)].name == "rng_seed"
        seeded = [n for n in prog.forward.graph.nodes if n.target is SEEDED_DROPOUT]
        assert len(seeded) == 3
        masks = {n.name for n in prog.forward.graph.nodes if n.op == "call_function" and n.args
                 and getattr(n.args[0], "target", None) is SEEDED_DROPOUT and n.args[1] == 1}
        assert masks <= set(prog.saved) and not any(n.name in prog.recomputed for n in seeded)
        calls[coords] = [n.args[3:] for n in seeded]
    assert _drop_layouts(plan) == {DROPS[0]: _lay(dp=Shard(0), tp=Shard(1)), DROPS[1]: _lay(dp=Shard(0), tp=Partial()),
                                   DROPS[2]: _lay(dp=Shard(0))}
    assert [c[0] for c in calls[(0, 0)]] == [stream_key(n) for n in DROPS]
    hidden = {k: v[0] for k, v in calls.items()}
    assert len(set(hidden.values())) == 4
    for i in (1, 2):
        out = {k: v[i] for k, v in calls.items()}
        assert out[(0, 0)] == out[(0, 1)] != out[(1, 0)] == out[(1, 1)]


# --- what the workers run ---------------------------------------------------------------------------------------
def _step_masks(pm, inputs) -> tuple[float, dict[int, torch.Tensor]]:
    """One training forward and backward; the loss and this rank's masks by dropout node key (what the
    program saved for backward)."""
    packed: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        loss = pm(*inputs)
    assert len(packed) == len(pm.program().saved), (len(packed), pm.program().saved)
    nodes = {n.name: n for n in pm.program().joint.gm.graph.nodes}
    masks = {}
    for name, t in zip(pm.program().saved, packed):
        n = nodes[name]
        if n.op == "call_function" and n.args and getattr(n.args[0], "target", None) is SEEDED_DROPOUT:
            if n.args[1] == 1:
                masks[n.args[0].args[3]] = t.clone()
    loss.backward()
    return loss.item(), masks


def _run(pm, inputs) -> dict:
    opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=1e-6)
    out = {"losses": [], "masks": []}
    for step in range(STEPS):
        opt.zero_grad()
        loss, masks = _step_masks(pm, inputs)
        out["losses"].append(loss)
        out["masks"].append(masks)
        if step == 0:
            out["grads"] = {k: p.grad.full_tensor().clone() for k, p in pm.named_parameters()}
        opt.step()
    out["weights"] = {k: p.full_tensor().detach().clone() for k, p in pm.named_parameters()}
    return out


def train_with_dropout(plan: str) -> dict:
    from autopar.testing.dist import cpu_mesh

    rank = torch.distributed.get_rank()
    mesh = cpu_mesh(tuple(SHAPE), tuple(NAMES))
    res = {"coords": tuple(int(c) for c in mesh.get_coordinate())}
    # Each rank's own generator differs: the masks must follow rank 0's seed, sent to every rank.
    for run in ("first", "again"):
        model, inputs = build()
        torch.manual_seed(100 + rank)
        pm = autopar.parallelize(model, mesh, inputs, loss_fn=mse, plan=Plan.from_json(plan))
        res[run] = _run(pm, inputs)
    model, inputs = build()
    pm = autopar.parallelize(model, mesh, inputs, loss_fn=mse, plan=Plan.from_json(plan), seed=7)
    res["seed7"] = _step_masks(pm, inputs)[1]
    pm.manual_seed(7)
    res["seed7_restarted"] = _step_masks(pm, inputs)[1]
    return res


# --- the checks in this process ---------------------------------------------------------------------------------
def _global_mask(shape, layout, per_rank: dict[tuple, torch.Tensor], what: str) -> torch.Tensor:
    """The global mask from every rank's piece; ranks holding the same piece must agree bit for bit."""
    stored = tuple(Replicate() if isinstance(p, Partial) else p for p in layout)
    index = torch.arange(math.prod(shape)).reshape(shape)
    full = torch.full((math.prod(shape),), -1, dtype=torch.int8)
    for coords, local in per_rank.items():
        idx = local_shard(index, stored, coords, SHAPE).reshape(-1)
        have = full[idx]
        new = local.reshape(-1).to(torch.int8)
        seen = have >= 0
        assert torch.equal(have[seen], new[seen]), f"{what}: ranks holding the same piece drew different masks"
        full[idx] = new
    assert (full >= 0).all()
    return full.reshape(shape).bool()


def _reference(masks: list[dict[str, torch.Tensor]]) -> dict:
    """The single-device model trained with the given masks."""
    model, inputs = build()
    model.drop1, model.drop2, model.drop3 = FixedMask(P_DROP), FixedMask(P_DROP), FixedMask(P_DROP)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=1e-6)
    out = {"losses": [], "before": {k: p.detach().clone() for k, p in model.named_parameters()}}
    for step in range(STEPS):
        for i, name in enumerate(DROPS):
            model.get_submodule(f"drop{i + 1}").mask = masks[step][name]
        opt.zero_grad()
        loss = mse(model(*inputs), *inputs)
        loss.backward()
        if step == 0:
            out["grads"] = {k: p.grad.clone() for k, p in model.named_parameters()}
        opt.step()
        out["losses"].append(loss.item())
    out["weights"] = {k: p.detach().clone() for k, p in model.named_parameters()}
    return out


@pytest.mark.slow
def test_replicas_share_masks_and_shards_do_not():
    pool = get_pool(4)  # boots while this process plans
    plan_text = plan_json()
    plan = Plan.from_json(plan_text)
    lays = _drop_layouts(plan)
    results = pool.run(train_with_dropout, plan_text)
    by_coords = {r["coords"]: r for r in results}
    assert sorted(by_coords) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    keys = {name: stream_key(name) for name in DROPS}
    shapes = {DROPS[0]: (16, 64), DROPS[1]: (16, 32), DROPS[2]: (16, 32)}

    global_masks = []
    for step in range(STEPS):
        masks = {}
        for name in DROPS:
            pieces = {c: r["first"]["masks"][step][keys[name]] for c, r in by_coords.items()}
            masks[name] = _global_mask(shapes[name], lays[name], pieces, f"{name} at step {step}")
            keep = masks[name].float().mean().item()
            assert abs(keep - (1 - P_DROP)) < 0.1, (name, step, keep)
            # Different batch shards (dp) draw different masks.
            assert not torch.equal(pieces[(0, 0)], pieces[(1, 0)]), (name, step)
        global_masks.append(masks)
    assert not torch.equal(global_masks[0][DROPS[0]], global_masks[1][DROPS[0]])  # a new mask each step
    # The parallel run is the single-device run with these masks: losses, gradients and weights.
    ref = _reference(global_masks)
    for c, r in by_coords.items():
        got = r["first"]
        assert all(math.isfinite(v) for v in got["losses"])
        assert_all_close([(f"losses on {c}", torch.tensor(got["losses"]), torch.tensor(ref["losses"])),
                          *grad_pairs(got["grads"], ref["grads"], f" on {c}"),
                          *update_pairs(got["weights"], ref["weights"], ref["before"], LR, f" over {STEPS} steps on {c}")])
        # Same seed, same masks and losses, run to run.
        assert got["losses"] == r["again"]["losses"], c
        for a, b in zip(got["masks"], r["again"]["masks"]):
            assert all(torch.equal(a[k], b[k]) for k in a), c
        # Another seed, other masks; manual_seed restarts the stream.
        assert not torch.equal(r["seed7"][keys[DROPS[0]]], got["masks"][0][keys[DROPS[0]]])
        assert all(torch.equal(r["seed7"][k], r["seed7_restarted"][k]) for k in r["seed7"])


def test_hf_gpt2_default_dropout_has_rules():
    """GPT-2's default config (dropout 0.1 on embeddings, attention and residuals): every dropout has a rule."""
    tf = pytest.importorskip("transformers")
    from autopar.capture import capture

    cfg = tf.GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=1, n_head=4, attn_implementation="sdpa",
                        bos_token_id=0, eos_token_id=0)
    assert cfg.resid_pdrop > 0 and cfg.attn_pdrop > 0 and cfg.embd_pdrop > 0
    ids = torch.randint(0, 128, (4, 16))
    cap = capture(tf.GPT2LMHeadModel(cfg), (ids,), {"labels": ids})
    drops = [n for n in cap.compute_nodes() if "dropout" in str(n.target)]
    assert len(drops) == 8  # embeddings, attention probabilities, attention and MLP outputs; forward and backward
    assert all(axis_strategies(op_info(n))[1] for n in drops)
