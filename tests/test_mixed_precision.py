"""bf16 mixed precision: the generated program computes in bf16 from fp32 master weights and trains like one
device under torch.autocast("cpu", dtype=torch.bfloat16).

Plans are made once in this process (as in test_execution.py) and shipped to the gloo worker pool as JSON.
"""
from __future__ import annotations

import functools
import math

import pytest
import torch
from torch.distributed.tensor import Shard

import autopar
from autopar.codegen import RankSpec
from autopar.compiler import compile_plan
from autopar.config import Config, SolverConfig
from autopar.cost import CPU_DEFAULT, GPU_DEFAULT, resolve_precision
from autopar.errors import PlanMismatchError
from autopar.plan import Plan
from autopar.testing.dist import get_pool

from test_execution import MESHES, _mesh, _pins, build

QUIET = SolverConfig(show_progress=False)
BF16 = Config(solver=QUIET, mixed_precision="bf16")
STEPS = 2
LR = 1e-3
# AdamW's eps in these comparisons: 0.1, not 1e-6. bf16 gradients carry rounding noise of about 0.6% of their
# largest entry, and with a small eps AdamW turns noise in a near-zero gradient entry into a whole +-lr step
# (measured on the Llama: with eps 1e-6 entries differ by 2 lr after 2 steps, with 1e-4 by 0.8 lr, with 1e-2 by
# 2% of the largest update). With eps 0.1 each update is a smooth function of its gradient and the updates
# differ elementwise by at most 0.57% of the tensor's largest update, so they are held to the gradients'
# tolerance below.
EPS = 0.1


# --- resolution: one function for capture and cost model ------------------------------------------------------
def test_precision_resolves_once_for_capture_and_cost_model():
    assert resolve_precision(None, "cuda") is GPU_DEFAULT and resolve_precision(None, "cpu") is CPU_DEFAULT
    assert resolve_precision("bf16", "cpu") is GPU_DEFAULT and resolve_precision("fp32", "cuda") is CPU_DEFAULT
    assert GPU_DEFAULT.autocast_dtype == torch.bfloat16 and GPU_DEFAULT.name == "bf16"
    assert CPU_DEFAULT.autocast_dtype is None and CPU_DEFAULT.name == "fp32"
    model, inputs, loss_fn = build("mlp")
    with pytest.raises(ValueError, match=r"unknown mixed_precision 'fp16'.*'bf16'.*'fp32'.*None"):
        autopar.plan(model, autopar.fake_mesh(4, "dp", "cpu"), inputs, loss_fn=loss_fn,
                     config=Config(solver=QUIET, mixed_precision="fp16"))


# --- the generated program, read without running it -----------------------------------------------------------
def _fsdp_program(mixed_precision: str):
    """A wide MLP under FSDP on 4 ranks of an H100 mesh, batch sharded: rank 1's program."""
    from test_codegen import _mlp, mse

    model, inputs = _mlp(256, 1024, 256, 4096)
    config = Config(solver=QUIET, device="h100", template_layers=None, mixed_precision=mixed_precision,
                    pins={"*": (Shard(0),)}, input_placements={0: (Shard(0),), 1: (Shard(0),)})
    comp = compile_plan(model, autopar.fake_mesh(4, "dp"), inputs, loss_fn=mse, config=config)
    return comp.plan, comp.program(RankSpec.fake(("dp",), (4,), (1,)))


def _collective_dtypes(prog, kind: str, min_numel: int = 0) -> list[torch.dtype]:
    return [n.args[0].meta["val"].dtype for gm in (prog.forward, prog.backward) for n in gm.graph.nodes
            if n.op == "call_function" and kind in str(n.target) and n.args[0].meta["val"].numel() >= min_numel]


def _op_dtypes(prog, op: str) -> set[torch.dtype]:
    return {n.meta["val"].dtype for gm in (prog.forward, prog.backward) for n in gm.graph.nodes
            if n.op == "call_function" and str(n.target) == f"aten.{op}.default"}


def test_fsdp_casts_each_shard_then_gathers_bf16():
    """FSDP2 with param_dtype=bf16: the fp32 shard is cast on its rank and the bf16 copy gathered (half the
    bytes of gathering fp32); matmuls run in bf16, gradients are reduce-scattered into fp32 shards."""
    plan, prog = _fsdp_program("bf16")
    assert plan.mixed_precision == "bf16" and Plan.from_json(plan.to_json()).mixed_precision == "bf16"
    assert "bf16 compute (fp32 master weights)" in plan.summary().splitlines()[0]
    # Every weight is gathered in bf16 (a bias of a few hundred bytes costs the same either way, latency).
    gathers = _collective_dtypes(prog, "all_gather", min_numel=4096)
    assert gathers and set(gathers) == {torch.bfloat16}, prog.code()
    assert set(_collective_dtypes(prog, "reduce_scatter")) == {torch.float32}, prog.code()
    assert _op_dtypes(prog, "addmm") | _op_dtypes(prog, "mm") == {torch.bfloat16}
    # Parameters enter and gradients leave in fp32.
    assert {n.meta["val"].dtype for n in prog.forward.graph.nodes if n.op == "placeholder"} == {torch.float32}
    out = next(n for n in prog.backward.graph.nodes if n.op == "output")
    assert {g.meta["val"].dtype for g in out.args[0]} == {torch.float32}
    assert "torch.ops.aten._to_copy.default(fc1_weight, dtype = torch.bfloat16)" in prog.code()
    # fp32: no casts, fp32 gathers, and the bf16 plan's step is cheaper (half the bytes, bf16 matmul rate).
    plan32, prog32 = _fsdp_program("fp32")
    assert plan32.mixed_precision == "fp32" and "_to_copy" not in prog32.code()
    assert set(_collective_dtypes(prog32, "all_gather")) == {torch.float32}
    assert plan.estimated_step_time < plan32.estimated_step_time



def test_bf16_fsdp_gathers_one_bucket_per_layer_and_dtype():
    """Casts of a layer's weights gather in one bf16 collective, its fp32 norm weights in one more: one bucket
    per layer more than the fp32 program, and one more for the final norm (fp32) beside the head (bf16)."""
    from autopar.codegen import collectives
    from autopar.models.llama import LLAMA_TINY, Llama, cross_entropy_loss

    with torch.device("meta"):
        model = Llama(LLAMA_TINY)
    tokens = torch.zeros(8, 16, dtype=torch.long)
    gathers = {}
    for mp in ("bf16", "fp32"):
        config = Config(solver=QUIET, device="h100", mixed_precision=mp, pins={"*": (Shard(0),)},
                        input_placements={0: (Shard(0),)})
        comp = compile_plan(model, autopar.fake_mesh(4, "dp"), (tokens,), loss_fn=cross_entropy_loss, config=config)
        prog = comp.program(RankSpec.fake(("dp",), (4,), (1,)))
        gathers[mp] = [k for k, _ in collectives(prog.forward) if k == "all_gather"]
        cats = [n for n in prog.forward.graph.nodes if n.target is torch.ops.aten.cat.default
                and any("all_gather" in str(u.target) for u in n.users)]
        assert cats and all(c.meta["val"].dtype == (torch.bfloat16 if mp == "bf16" else torch.float32)
                            or c.meta["val"].numel() < 4096 for c in cats), prog.code()
    layers = LLAMA_TINY.n_layers
    assert len(gathers["bf16"]) == len(gathers["fp32"]) + layers + 1, gathers

def test_plan_of_another_precision_is_refused():
    from autopar.compiler import capture_step
    from autopar.plan_check import check_plan

    model, inputs, loss_fn = build("mlp")
    mesh = autopar.fake_mesh(4, "dp", "cpu")
    plan = autopar.plan(model, mesh, inputs, loss_fn=loss_fn, config=BF16)
    comp = capture_step(model, mesh, inputs, None, loss_fn, Config(solver=QUIET), template_layers=None)
    with pytest.raises(PlanMismatchError, match=r"made for mixed_precision='bf16'.*resolves .* to 'fp32'"):
        check_plan(plan, comp)


# --- real collectives: bf16 parallel runs against one device under autocast -----------------------------------
# Tolerances. Both sides compute in bf16 (unit roundoff 2**-9 ~ 2e-3) from the same casts; they differ only where
# the parallel program reduces differently: a sharded matmul rounds each rank's partial product to bf16 before
# the fp32 reduction, one device rounds the full product once. Measured on the Llama (the MLP programs match one
# device bit for bit): gradients within 6e-3 norm-relative and 7.0e-3 of the tensor's largest entry elementwise,
# weight updates (after - before, with EPS above) within 4.4e-3 norm-relative and 5.7e-3 of the largest update
# elementwise, losses within 2e-5. So gradients and weight updates are held to 2e-2, norm-relative and
# elementwise (atol 2e-2 of the tensor's largest entry, rtol 2e-2), losses to 1e-3. A missing or misplaced collective fails
# by far: one rank's unreduced gradient is 0.7-0.9 off (norm-relative) on both models. An fp32-compute program
# would pass these tolerances (fp32 sits 3e-3..8e-3 from the bf16 reference, as close as bf16 reorderings), so
# the test asserts bf16 compute from the program itself: every matmul of the generated graphs returns bf16.
LOSS_RTOL, RTOL = 1e-3, 2e-2


@functools.lru_cache(maxsize=None)
def plan_json(name: str, mesh: str, kind: str) -> str:
    shape, names = MESHES[mesh]
    model, inputs, loss_fn = build(name)
    config = BF16.with_(template_layers=None, pins=_pins(name, names, kind))
    plan = autopar.plan(model, autopar.fake_mesh(shape, names, "cpu"), inputs, loss_fn=loss_fn, config=config)
    return plan.to_json()


def _full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _train(model_or_pm, step) -> dict:
    """STEPS AdamW steps: the losses, the first step's gradients, the weights after the last (full tensors)."""
    named = dict(model_or_pm.named_parameters())
    opt = torch.optim.AdamW(list(named.values()), lr=LR, eps=EPS)
    out = {"losses": []}
    for i in range(STEPS):
        opt.zero_grad()
        loss = step()
        loss.backward()
        if i == 0:
            out["grads"] = {k: _full(p.grad) for k, p in named.items()}
            out["grad_dtypes"] = {p.grad.dtype for p in named.values()}
        opt.step()
        out["losses"].append(loss.item())
    out["weights"] = {k: _full(p) for k, p in named.items()}
    out["param_dtypes"] = {p.dtype for p in named.values()}
    return out


def train_parallel_bf16(name: str, mesh: str, plan: str, evaluate: bool = False) -> dict:
    shape, names = MESHES[mesh]
    model, inputs, loss_fn = build(name)
    # No config: parallelize runs the precision the plan records.
    pm = autopar.parallelize(model, _mesh(shape, names), inputs, loss_fn=loss_fn, plan=Plan.from_json(plan))
    evaluated = {}
    if evaluate:  # eval mode traces and plans its own forward-only program: in the training precision too
        pm.eval()
        with torch.no_grad():
            evaluated["eval_loss"] = pm(*inputs).item()
        evaluated["eval_matmul_dtypes"] = _matmul_dtypes(pm.eval_program(*inputs).forward)
        pm.train()
    out = _train(pm, lambda: pm(*inputs))
    out.update(evaluated, matmul_dtypes=_matmul_dtypes(pm.program().forward) | _matmul_dtypes(pm.program().backward),
               code=pm.local_code())
    return out if torch.distributed.get_rank() == 0 else {"losses": out["losses"]}


def _matmul_dtypes(gm) -> set[torch.dtype]:
    matmuls = {"aten.mm.default", "aten.addmm.default", "aten.bmm.default"}
    return {n.meta["val"].dtype for n in gm.graph.nodes if n.op == "call_function" and str(n.target) in matmuls}


@functools.lru_cache(maxsize=None)
def reference(name: str) -> dict:
    """One device, fp32 parameters, the step under autocast as a user writes it (backward outside)."""
    model, inputs, loss_fn = build(name)
    before = {k: p.detach().clone() for k, p in model.named_parameters()}

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return loss_fn(model(*inputs), *inputs)
    return dict(_train(model, step), before=before)


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    rel = ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()
    assert rel <= RTOL, f"{what}: norm-relative error {rel:.2e} > {RTOL}"
    torch.testing.assert_close(got, want, rtol=RTOL, atol=RTOL * want.abs().max().item(), msg=lambda m: f"{what}: {m}")


CASES = [("mlp", "dp4", "fsdp"), ("mlp", "dp2xtp2", "fsdp_tp"), ("llama", "dp4", "fsdp"),
         ("llama", "dp2xtp2", "fsdp_tp")]


@pytest.mark.slow
@pytest.mark.parametrize("name,mesh,kind", CASES, ids=["-".join(c) for c in CASES])
def test_bf16_trains_like_one_device_under_autocast(name, mesh, kind):
    pool = get_pool(math.prod(MESHES[mesh][0]))  # boots in the background while this process plans
    evaluate = name == "mlp"  # a small eval capture: the MLP has no dropout, so it computes the first loss
    plan = plan_json(name, mesh, kind)
    placements = Plan.from_json(plan).param_placements()  # FSDP: every weight sharded over dp
    assert all(isinstance(lay[0], Shard) for lay in placements.values()), placements
    results = pool.run(train_parallel_bf16, name, mesh, plan, evaluate)
    ref = reference(name)
    for rank, r in enumerate(results):
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=LOSS_RTOL, atol=0,
                                   msg=lambda m: f"losses on rank {rank}: {m}")
    got = results[0]
    assert got["matmul_dtypes"] == {torch.bfloat16}, got["matmul_dtypes"]
    if evaluate:
        assert got["eval_matmul_dtypes"] == {torch.bfloat16}, got["eval_matmul_dtypes"]
        assert got["eval_loss"] == pytest.approx(ref["losses"][0], rel=LOSS_RTOL)
    assert "dtype = torch.bfloat16" in got["code"] and "_c10d_functional" in got["code"]
    assert got["param_dtypes"] == got["grad_dtypes"] == {torch.float32}  # master weights, fp32 gradients
    assert set(got["grads"]) == set(ref["grads"])
    for k in ref["grads"]:
        _close(got["grads"][k], ref["grads"][k], f"grad of {k}")
        before = ref["before"][k].double()
        _close(got["weights"][k].double() - before, ref["weights"][k].double() - before,
               f"update of {k} over {STEPS} AdamW steps")


def loss_with_and_without_autocast(plan: str) -> tuple[float, float]:
    model, inputs, loss_fn = build("mlp")
    pm = autopar.parallelize(model, _mesh(*MESHES["dp4"]), inputs, loss_fn=loss_fn, plan=Plan.from_json(plan))
    with torch.no_grad():
        plain = pm(*inputs).item()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            wrapped = pm(*inputs).item()
    return plain, wrapped


@pytest.mark.slow
def test_autocast_around_the_call_changes_nothing():
    """The program holds the casts its plan priced; a caller's autocast region does not recast an fp32 plan."""
    shape, names = MESHES["dp4"]
    model, inputs, loss_fn = build("mlp")
    config = Config(solver=QUIET, template_layers=None, pins=_pins("mlp", names, "fsdp"))
    plan = autopar.plan(model, autopar.fake_mesh(shape, names, "cpu"), inputs, loss_fn=loss_fn, config=config)
    assert plan.mixed_precision == "fp32"
    for plain, wrapped in get_pool(4).run(loss_with_and_without_autocast, plan.to_json()):
        assert plain == wrapped
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # what autocast would have done
        assert loss_fn(model(*inputs), *inputs).item() != plain
