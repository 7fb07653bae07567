"""Gradient accumulation: Config(microbatches=N) plans one microbatch's graph, `pm.step` runs every microbatch
and reduces gradients once per step, and the step equals the full batch's on one device, padding included."""
from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard

import autopar
from autopar.compiler import compile_plan
from autopar.config import Config, SolverConfig
from autopar.errors import InfeasibleMemoryError
from autopar.microbatch import split_batch
from autopar.models import LLAMA_TINY, Llama
from autopar.plan import Plan
from autopar.testing.dist import get_pool

R = Replicate()
QUIET = SolverConfig(show_progress=False)
MESH = ((2, 2), ("dp", "tp"))


class LM(Llama):
    """The example Llama called with (tokens, labels)."""

    def forward(self, tokens, labels):
        return super().forward(tokens)


def lm_loss(logits, tokens, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


def build(padded: bool = True):
    """The model and a batch of 8 whose padding (-100 labels) falls unevenly into 4 microbatches of 2 rows:
    the first mostly padding, the second none counted at all."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, LLAMA_TINY.vocab_size, (8, 16), generator=gen)
    labels = torch.randint(0, LLAMA_TINY.vocab_size, (8, 16), generator=gen)
    if padded:
        labels[0:2, 3:] = -100
        labels[2:4] = -100
        labels[5, 10:] = -100
    return LM(LLAMA_TINY), (tokens, labels)


def _pins(kind: str) -> dict:
    if kind == "dp":  # gradients all-reduced over dp
        return {"*": (R, R)}
    col = ("*.w1.weight", "*.w3.weight", "*.wq.weight", "*.wk.weight", "*.wv.weight")
    row = ("*.w2.weight", "*.wo.weight")
    pins = {p: (Shard(0), Shard(0)) for p in col}  # FSDP on dp (reduce-scatter) x Megatron on tp
    pins.update({p: (Shard(0), Shard(1)) for p in row})
    pins["*"] = (Shard(0), R)
    return pins


@functools.lru_cache(maxsize=None)
def plan_json(kind: str, microbatches: int) -> str:
    model, inputs = build()
    config = Config(microbatches=microbatches, pins=_pins(kind), input_placements={0: (Shard(0), R), 1: (Shard(0), R)},
                    solver=QUIET)
    comp = compile_plan(model, autopar.fake_mesh(*MESH, "cpu"), inputs, loss_fn=lm_loss, config=config,
                        template_layers=None)
    return comp.plan.to_json()


# --- what the workers run -----------------------------------------------------------------------------------
class _CountCollectives(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ns = func.namespace if hasattr(func, "namespace") else ""
        if ns == "_c10d_functional" and "wait" not in func.__name__:
            self.n += 1
        return func(*args, **(kwargs or {}))


def train_microbatched(plan: str, mutate: str = "") -> dict:
    from autopar.testing.dist import cpu_mesh

    model, inputs = build()
    mesh = cpu_mesh(tuple(MESH[0]), tuple(MESH[1]))
    pm = autopar.parallelize(model, mesh, inputs, loss_fn=lm_loss, plan=Plan.from_json(plan))
    prog = pm.program()
    if mutate == "equal_weights":  # negative control: average the microbatches instead of weighing by count
        prog.loss_reduction, prog.returns_count = "mean", prog.returns_count
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, eps=1e-6)
    out = {"losses": []}
    for step in range(3):
        opt.zero_grad()
        if step == 0:
            with _CountCollectives() as counter:
                loss = pm.step(*inputs)
            out["executed"] = counter.n
            out["grads"] = {k: p.grad.full_tensor() for k, p in pm.named_parameters()}
        else:
            loss = pm.step(*inputs)
        opt.step()
        out["losses"].append(loss.item())
    out["weights"] = {k: p.full_tensor().detach() for k, p in pm.named_parameters()}
    graphs = [c.graph for c in prog.collectives]
    out["per_graph"] = {g: graphs.count(g) for g in ("forward", "backward", "grad_sync")}
    try:
        pm(*inputs)
    except ValueError as e:
        out["call_error"] = str(e)
    return out if torch.distributed.get_rank() == 0 else {"losses": out["losses"]}


@functools.lru_cache(maxsize=None)
def reference() -> dict:
    model, inputs = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    out = {"losses": []}
    for step in range(3):
        opt.zero_grad()
        loss = lm_loss(model(*inputs), *inputs)
        loss.backward()
        if step == 0:
            out["grads"] = {k: p.grad.clone() for k, p in model.named_parameters()}
        opt.step()
        out["losses"].append(loss.item())
    out["weights"] = {k: p.detach().clone() for k, p in model.named_parameters()}
    return out


def _close(a, b, what):
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m: f"{what}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fsdp_tp", "dp"])
def test_four_microbatches_equal_the_full_padded_batch(kind):
    pool = get_pool(4)
    plan = plan_json(kind, 4)
    p = Plan.from_json(plan)
    assert p.microbatches == 4
    lay = p.param_placements()["layers.0.feed_forward.w1.weight"]
    assert lay == ((Shard(0), Shard(0)) if kind == "fsdp_tp" else (R, R))
    results = pool.run(train_microbatched, plan)
    ref = reference()
    for rank, r in enumerate(results):
        _close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), f"losses on rank {rank}")
    got = results[0]
    for k in ref["grads"]:
        _close(got["grads"][k], ref["grads"][k], f"grad of {k}")
        _close(got["weights"][k], ref["weights"][k], f"{k} after 3 AdamW steps")
    # Gradient collectives once per step: every microbatch runs the forward's collectives, each one with a
    # counted token (3 of the 4) the backward's, and the gradient reductions run once.
    n = got["per_graph"]
    assert n["grad_sync"] > 0, n
    assert got["executed"] == 4 * n["forward"] + 3 * n["backward"] + n["grad_sync"], (got["executed"], n)
    assert "pm.step" in got["call_error"]


@pytest.mark.slow
def test_weighing_microbatches_equally_fails_on_padded_batches():
    """Negative control: the comparison above catches a step that averages microbatch losses instead of
    normalizing by the global count of counted tokens."""
    pool = get_pool(4)
    got = pool.run(train_microbatched, plan_json("fsdp_tp", 4), "equal_weights")[0]
    ref = reference()
    with pytest.raises(AssertionError):
        _close(got["grads"]["output.weight"], ref["grads"]["output.weight"], "grad")


# --- one process: splitting, planning, errors ---------------------------------------------------------------
def test_split_batch_chunks_tensors_along_dim0_and_passes_others():
    x, y = torch.arange(12).reshape(6, 2), torch.arange(6)
    parts = split_batch((x, 3), {"y": y, "s": torch.tensor(2.0)}, 3)
    assert len(parts) == 3
    assert torch.equal(parts[1][0][0], x[2:4]) and parts[1][0][1] == 3
    assert torch.equal(parts[2][1]["y"], y[4:]) and parts[2][1]["s"].item() == 2.0
    with pytest.raises(ValueError, match="microbatches=4 does not divide the batch.*1, 2, 3, 6"):
        split_batch((x,), {}, 4)


def test_config_rejects_bad_microbatches():
    for bad in (0, -2, "many", 1.5, True):
        with pytest.raises(ValueError, match="microbatches"):
            Config(microbatches=bad)


def test_capture_reads_how_the_loss_adds_up_over_microbatches():
    from autopar.capture import capture

    model, inputs = build()
    assert capture(model, inputs, None, lm_loss).loss_reduction == "count"
    assert capture(model, inputs, None, lambda out, *a: out.float().sum()).loss_reduction == "sum"
    assert capture(model, inputs, None, lambda out, *a: (out ** 2).mean()).loss_reduction == "mean"


@pytest.mark.slow
def test_plan_counts_one_microbatch_of_activations_and_records_the_count():
    """Four microbatches of a 16-row batch plan the graph of a 4-row batch: its activations, its placements;
    the step does four times the work and reduces the gradients once."""
    with torch.device("meta"):
        model = Llama(LLAMA_TINY)
    tokens = torch.randint(0, 256, (16, 64))
    mesh = autopar.fake_mesh((2, 2), ("dp", "tp"), "h100")

    def plan(batch, m):
        return autopar.plan(model, mesh, (tokens[:batch],),
                            loss_fn=lambda o, t: F.cross_entropy(o.flatten(0, 1), t.flatten()),
                            config=Config(microbatches=m, solver=QUIET))

    small, two, four = plan(4, 1), plan(8, 2), plan(16, 4)
    assert (small.microbatches, four.microbatches) == (1, 4)
    assert Plan.from_json(four.to_json()).microbatches == 4
    # A microbatch of 4 sequences either way. (With one microbatch the gradients live where the backward
    # produces them; with several they accumulate over the step, so the peaks fall elsewhere.)
    assert four.memory_breakdown["activations"] == two.memory_breakdown["activations"]
    assert four.estimated_step_time > 3 * small.estimated_step_time
    whole = plan(16, 1)
    assert whole.memory_breakdown["activations"] > 1.5 * four.memory_breakdown["activations"]


@pytest.mark.slow
def test_auto_takes_the_fewest_microbatches_that_fit():
    with torch.device("meta"):
        model = Llama(LLAMA_TINY)
    tokens = torch.randint(0, 256, (8, 64))
    mesh = autopar.fake_mesh((2,), ("dp",), "h100")
    loss = lambda o, t: F.cross_entropy(o.flatten(0, 1), t.flatten())  # noqa: E731

    def plan(m, limit_bytes=None):
        limit = limit_bytes / 2**30 if limit_bytes else None
        return autopar.plan(model, mesh, (tokens,), loss_fn=loss,
                            config=Config(microbatches=m, memory_limit_gb=limit, solver=QUIET))

    assert plan("auto").microbatches == 1  # fits at once
    limit = 1.8e6  # bytes per rank: no plan of 1 or 2 microbatches fits, one of 4 does
    with pytest.raises(InfeasibleMemoryError):
        plan(2, limit)
    auto = plan("auto", limit)
    assert auto.microbatches == 4 and auto.peak_memory_per_rank <= limit
    assert auto.config["microbatches"] == "auto"
    with pytest.raises(InfeasibleMemoryError, match="tried microbatches 1, 2, 4, 8"):
        plan("auto", 1.2e6)


def test_microbatches_must_divide_the_batch():
    model, inputs = build()
    with pytest.raises(ValueError, match="microbatches=3 does not divide the batch"):
        autopar.plan(model, autopar.fake_mesh(*MESH, "cpu"), inputs, loss_fn=lm_loss,
                     config=Config(microbatches=3, solver=QUIET))


def test_batch_norm_under_microbatching_is_refused():
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    x = torch.randn(8, 8)
    with pytest.raises(ValueError, match="batch norm in training mode .* microbatches=2"):
        autopar.plan(model, autopar.fake_mesh((2,), ("dp",), "cpu"), (x,), loss_fn=lambda o, x: o.mean(),
                     config=Config(microbatches=2, solver=QUIET))


@pytest.mark.slow
def test_program_of_several_microbatches_reduces_gradients_in_grad_sync_only():
    plan = Plan.from_json(plan_json("fsdp_tp", 4))
    model, inputs = build()
    prog = autopar.program(plan, 3, model=model, example_inputs=inputs, loss_fn=lm_loss)
    assert prog.microbatches == 4 and prog.returns_count and prog.loss_reduction == "count"
    assert [tuple(i.shape) for i in prog.inputs] == [(2, 16), (2, 16)]
    # The gradient buckets moved from the backward to grad_sync, and so did every other gradient collective.
    def buckets(p):
        return sorted((c.graph, c.kind, c.bucket) for c in p.collectives if c.bucket and c.kind != "all_gather")

    one = Plan.from_json(plan_json("fsdp_tp", 1))
    whole = autopar.program(one, 3, model=model, example_inputs=inputs, loss_fn=lm_loss)
    assert "reduce_scatter" in {k for _, k, _ in buckets(prog)}
    assert {g for g, _, _ in buckets(prog)} == {"grad_sync"}
    assert {g for g, _, _ in buckets(whole)} == {"backward"}  # one microbatch: reduced in the backward
    grad_of = [c for c in prog.collectives if "gradient of" in (c.value or "")]
    assert grad_of and all(c.graph == "grad_sync" for c in grad_of)
    assert "# grad_sync" in prog.code() and "grad_sync" in str(prog)
    assert math.prod(prog.grad_sync.graph.find_nodes(op="placeholder")[0].meta["val"].shape) > 0
