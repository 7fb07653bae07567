"""Activation recomputation (autopar/recompute.py, passes/recompute_variants.py): what the planner chooses and
records, and that recomputing changes no number.

The execution tests run one training step of a Megatron plan on a (dp=2, tp=2) gloo mesh with every layer
selectively recomputed, fully recomputed, and the first layer in full and the second selectively, each against
the same placements keeping every activation, and require the loss and every gradient to be bitwise equal (the
recomputed ops see the same inputs, on the same kernels): the example Llama, and transformers'
LlamaForCausalLM with attention dropout 0.1 (masks are saved, never drawn again). The memory test holds the
plan's peak per rank to the measured one.
"""
from __future__ import annotations

import dataclasses
import functools
import warnings

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import autopar
from autopar.compiler import compile_plan
from autopar.config import Config, SolverConfig
from autopar.models import LLAMA_SMALL, LLAMA_TINY, Llama, cross_entropy_loss
from autopar.plan import Plan
from autopar.program import RankSpec
from autopar.testing.dist import get_pool

QUIET = SolverConfig(show_progress=False)
NAMES, SHAPE = ("dp", "tp"), (2, 2)
SCALARS = 4096  # bytes: scalar temporaries the memory model does not count
R = Replicate()


# --- models and plans ---------------------------------------------------------------------------------------
class WithLabels(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, labels):
        return self.model(input_ids=ids, labels=labels).loss


def _own_loss(out, *inputs):
    return out


def build(name: str):
    """(model, inputs, loss_fn), identical on every process."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    if name == "llama":
        return Llama(LLAMA_TINY), (torch.randint(0, LLAMA_TINY.vocab_size, (4, 16), generator=gen),), cross_entropy_loss
    from autopar.testing.hf_models import MODELS

    over = {"attention_dropout": 0.1} if name == "hf_llama_dropout" else {}
    model, args, kwargs = MODELS["llama"](batch=4, seq=16, **over)
    return WithLabels(model), (*args, kwargs["labels"]), _own_loss


def _megatron(name: str, model, inputs) -> dict:
    if name == "llama":
        col = ("*.w1.weight", "*.w3.weight", "*.wq.weight", "*.wk.weight", "*.wv.weight")
        pins = {p: (R, Shard(0)) for p in col}
        pins.update({p: (R, Shard(1)) for p in ("*.w2.weight", "*.wo.weight")})
        pins["*"] = (R, R)
        return {"pins": pins, "input_placements": {0: (Shard(0), R)}}
    from autopar import recipes
    from autopar.mesh import MeshSpec

    spec = MeshSpec(NAMES, SHAPE, ("loopback", "loopback"), "cpu")
    shapes = {k: tuple(p.shape) for k, p in model.named_parameters(remove_duplicate=False)}
    return recipes.recipe("megatron")(shapes, spec, n_inputs=len(inputs))


@functools.lru_cache(maxsize=None)
def compiled(name: str, recompute: str):
    model, inputs, loss_fn = build(name)
    config = Config(solver=QUIET, recompute=recompute, **_megatron(name, model, inputs))
    return compile_plan(model, autopar.fake_mesh(SHAPE, NAMES, "cpu"), inputs, loss_fn=loss_fn, config=config,
                        template_layers=None)


def one_step(name: str, plans: dict[str, str]) -> dict:
    """On every rank: per plan, the loss and every full gradient of one step, and what the program saves and
    recomputes."""
    from autopar.testing.dist import cpu_mesh

    out = {}
    for variant, text in plans.items():
        model, inputs, loss_fn = build(name)
        mesh = cpu_mesh(tuple(SHAPE), tuple(NAMES))
        pm = autopar.parallelize(model, mesh, inputs, loss_fn=loss_fn, plan=Plan.from_json(text), seed=0)
        loss = pm(*inputs)
        loss.backward()
        grads = {k: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
                 for k, p in pm.named_parameters() if p.grad is not None}
        prog = pm.program()
        out[variant] = {"loss": loss.detach().clone(), "grads": grads, "saved": len(prog.saved),
                        "recomputed": len(prog.recomputed)}
    return out


# --- execution: recomputation changes no number -----------------------------------------------------------
@pytest.mark.slow  # 4 gloo processes: make test only, so the fast tier stays under 3 minutes
@pytest.mark.parametrize("name,variants", [("llama", ("selective", "full")),
                                           ("hf_llama_dropout", ("full/1/selective",))], ids=["llama", "hf_llama_dropout"])
def test_recomputed_step_equals_kept_step_bitwise(name, variants):
    """Each recomputing plan against the same placements keeping every activation (the plan with its variant
    set to keep): recomputation pays for its redistributions, so the solver may place activations differently
    than it would without it, and the comparison holds placements fixed. The transformers Llama with attention
    dropout runs "full/1/selective" (layer 0 in full, layer 1 selective), which covers both kinds at once."""
    pool = get_pool(4)
    plans = {v: compiled(name, v).plan for v in variants}
    texts = {}
    for v, p in plans.items():
        assert "ac" in p.techniques and p.recomputed_stacks(), p.recompute
        assert any(isinstance(x, Shard) for lay in p.params.values() for x in lay[1:]), "no tensor parallelism"
        texts[v] = p.to_json()
        kept = Plan.from_json(texts[v])
        kept.recompute = {k: {"variant": "keep", "by": d["by"], "time_s": 0.0, "saved_bytes": 0}
                          for k, d in kept.recompute.items()}
        texts[f"{v}/keep"] = kept.to_json()
        assert Plan.from_json(texts[f"{v}/keep"]).recomputed_stacks() == []
    results = pool.run(one_step, name, texts)
    for rank, res in enumerate(results):
        for v in variants:
            got, kept = res[v], res[f"{v}/keep"]
            # The programs differ as the plans say: fewer saved tensors, more recomputed values.
            assert got["saved"] < kept["saved"] and got["recomputed"] > kept["recomputed"], (v, got, kept)
            assert torch.equal(got["loss"], kept["loss"]), (rank, v, got["loss"], kept["loss"])
            assert got["grads"].keys() == kept["grads"].keys()
            for k, g in kept["grads"].items():
                assert torch.equal(got["grads"][k], g), f"rank {rank}, {v}: gradient of {k} differs " \
                    f"by up to {(got['grads'][k] - g).abs().max().item():.3g}"
        if name == "llama":
            assert results[0]["full"]["saved"] < results[0]["selective"]["saved"]
    if name == "hf_llama_dropout":  # attention dropout draws masks in the layers that recompute
        assert plans["full/1/selective"].nodes["model.model.layers.*.self_attn/fwd/native_dropout"].op.startswith(
            "aten.native_dropout")


# --- planning -----------------------------------------------------------------------------------------------
def test_config_rejects_an_unknown_mode():
    with pytest.raises(ValueError, match="recompute='some'.*'auto'"):
        Config(recompute="some")
    for bad in ("full/0", "full/x", "selective/2", "full/2/full", "full/2/selective/1"):
        with pytest.raises(ValueError, match="'full/r' / 'full/r/selective'"):
            Config(recompute=bad)
    assert Config(recompute="full/2/selective").recompute == "full/2/selective"


# --- partial recomputation: the first r layers in full ------------------------------------------------------
FOUR = dataclasses.replace(LLAMA_TINY, n_layers=4)


@functools.lru_cache(maxsize=None)
def four_layers(recompute: str, limit_kib: float | None = None):
    torch.manual_seed(0)
    tokens = torch.randint(0, FOUR.vocab_size, (8, 64), generator=torch.Generator().manual_seed(1))
    return compile_plan(Llama(FOUR), autopar.fake_mesh((2,), ("dp",), "cpu"), (tokens,), loss_fn=cross_entropy_loss,
                        config=Config(solver=QUIET, recompute=recompute,
                                      memory_limit_gb=None if limit_kib is None else limit_kib * 2**10 / 2**30),
                        template_layers=None)


def test_partial_variants_recompute_the_first_layers_and_the_others_as_told():
    from autopar.recompute import partial_variants, recomputed_nodes, rederived_views

    cap = four_layers("off").ctx.captured
    layer = {n: i for n, (p, i) in cap.block_of.items()}
    # Whatever the variant, the views the backward reads are derived again (the flattened inputs of every
    # layer's matmuls, and the head's).
    views = rederived_views(cap)
    assert recomputed_nodes(cap, {"layers": "keep"}) == views
    assert {layer[n] for n in views if n in layer} == {0, 1, 2, 3} and any(n not in layer for n in views)
    full, sel = (recomputed_nodes(cap, {"layers": v}) for v in ("full", "selective"))
    assert sel < full and {layer[n] for n in full - views} == {0, 1, 2, 3}
    for r in (1, 2, 3):
        first = {n for n in full - views if layer[n] < r} | views
        assert recomputed_nodes(cap, {"layers": f"full/{r}"}) == first
        assert recomputed_nodes(cap, {"layers": f"full/{r}/selective"}) == first | {n for n in sel - views
                                                                                    if layer[n] >= r}
    assert recomputed_nodes(cap, {"layers": "full/4"}) == full
    # Offered in whole captured layers: a template of 2 captured layers of 32 offers half; 3 of 4 none.
    assert partial_variants(4, 4) == ["full/1", "full/2", "full/3", "full/1/selective", "full/2/selective",
                                      "full/3/selective"]
    assert partial_variants(32, 2) == ["full/16", "full/16/selective"]
    assert partial_variants(4, 3) == [] and partial_variants(1, 1) == []


def test_a_partial_variant_is_recorded_shown_and_round_trips():
    plans = {v: four_layers(v).plan for v in ("selective", "full/2/selective", "full")}
    p = plans["full/2/selective"]
    rc = p.recompute["layers"]
    assert rc["variant"] == "full" and rc["layers"] == 2 and rc["others"] == "selective" and rc["by"] == "config"
    # Half the layers in full and half selective: time and memory between the two.
    t = {v: q.recompute["layers"]["time_s"] for v, q in plans.items()}
    assert t["selective"] < t["full/2/selective"] < t["full"], t
    act = {v: q.memory_breakdown["activations"] for v, q in plans.items()}
    assert act["full"] < act["full/2/selective"], act
    assert Plan.from_json(p.to_json()) == p
    from autopar.recompute import plan_variants

    assert plan_variants(Plan.from_json(p.to_json())) == {"layers": "full/2/selective"}
    assert "layers: full on the first 2 of 4 layers, selective on the others, +" in str(p)
    text = p.explain("layers")
    assert "full on the first 2 of the 4 layers" in text and "the other layers: selective" in text
    with pytest.raises(autopar.PlanMismatchError, match="'others'"):
        Plan.from_json(p.to_json().replace('"others": "selective"', '"others": "full"'))


def test_the_joint_program_prices_each_partial_variant_as_the_program_with_it_fixed():
    """The selector of a stack offers the partial variants, and with the selector at one of them the joint
    program's objective and memory rows equal those of the program built with that variant fixed (a data
    parallel mesh: no activation changes layout, so the recompute links are exact)."""
    from autopar.passes import recompute_variants as rv
    from autopar.passes import solve_placements as sp

    ctx = four_layers("auto", 7600).ctx
    joint = rv.joint(ctx)
    assert joint is not None and joint.variants["layers"][3:] == (
        "full/1", "full/2", "full/3", "full/1/selective", "full/2/selective", "full/3/selective")
    limit = float(ctx.memory_limit)
    rv.apply(ctx, joint.base)
    both = sp.build_problem(ctx, limit, joint)
    choice = {k: ctx.choice[k] for k in both.n_strategies if not k.startswith(rv.SELECTOR)}
    seen = set()
    for r, v in enumerate(joint.variants["layers"]):
        rv.apply(ctx, {"layers": v})
        fixed = sp.build_problem(ctx, limit)
        pick = dict(choice, **{rv.SELECTOR + "layers": r})
        assert both.objective(pick) == pytest.approx(fixed.objective(choice), rel=1e-9), v
        assert both.memory.usage(pick) == pytest.approx(fixed.memory.usage(choice), rel=1e-9), v
        seen.add(round(fixed.memory.usage(choice)))
    assert len(seen) == len(joint.variants["layers"])  # every variant changes the peak


@pytest.mark.slow
def test_plan_records_the_variant_and_round_trips():
    plan = compiled("llama", "full").plan
    rc = plan.recompute["layers"]
    assert rc["variant"] == "full" and rc["by"] == "config" and rc["time_s"] > 0 and rc["saved_bytes"] > 0
    assert Plan.from_json(plan.to_json()) == plan
    assert "ac" in plan.techniques
    text = str(plan)
    assert "recompute" in text and "layers: full" in text and "ac" in text
    assert "full (each layer recomputed from its input)" in plan.explain("layers")
    from autopar.inspect.report import build_sections

    assert "layers: full, +" in build_sections(plan)[0][1]
    assert "recomputes its activations (full)" in plan.explain("layers.*.attention.wq/fwd/mm")
    assert "ac" not in compiled("llama", "off").plan.techniques
    # A hand-edited recompute entry is checked where the plan meets the model.
    from autopar.errors import PlanMismatchError
    from autopar.plan_check import check_plan

    check_plan(plan, compiled("llama", "off"))
    edited = Plan.from_json(plan.to_json())
    edited.recompute = {"blocks": dict(rc)}
    with pytest.raises(PlanMismatchError, match="recomputes the layer stack 'blocks', which this model lacks"):
        check_plan(edited, compiled("llama", "off"))
    with pytest.raises(autopar.PlanMismatchError, match="variant is one of"):
        Plan.from_json(plan.to_json().replace('"variant": "full"', '"variant": "most"'))


def test_recomputing_costs_time_and_saves_activation_memory():
    off, sel, full = (compiled("llama", v).plan for v in ("off", "selective", "full"))
    # The breakdown holds what is live at the peak: the saved activations where forward ends, or the gradients
    # and what is left of the activations late in the backward.
    peak = [p.peak_memory_per_rank for p in (off, sel, full)]
    assert peak[0] > peak[1] > peak[2], peak
    assert off.estimated_step_time < sel.estimated_step_time < full.estimated_step_time
    assert 0 < sel.recompute["layers"]["time_s"] < full.recompute["layers"]["time_s"]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["full", "gathered view"])
def test_recomputed_regions_redistribute_again_and_both_models_price_it(case):
    """Codegen runs a recomputed region again with its collectives (the Megatron layers' all-reduces of partial
    sums), and without recomputation the views the backward derives again (the sequence-parallel inputs of the
    matmuls, gathered again): the step simulator schedules them again, and the integer program charges exactly
    as much."""
    from autopar.passes import solve_placements as sp

    ctx = (compiled("llama", "full") if case == "full" else gathered_view_compiled()).ctx
    again = [e - b for lane, label, b, e in ctx.simulation.timeline
             if lane.startswith("comm:") and label.startswith("recompute ")]
    assert again and sum(again) > 0
    problem = sp.build_problem(ctx, None)
    choice = {k: ctx.choice[k] for k in problem.n_strategies}
    priced = problem.objective(choice)
    unpriced = sp._rerun_shares
    try:
        sp._rerun_shares = lambda ctx, share: [0.0] * len(ctx.edges)
        without = sp.build_problem(ctx, None).objective(choice)
    finally:
        sp._rerun_shares = unpriced
    assert priced - without == pytest.approx(sum(again), rel=1e-6)


@pytest.mark.slow
def test_a_joint_plan_that_underprices_its_recompute_collectives_is_solved_again_with_its_variants_fixed(monkeypatch):
    """transformers BERT (hidden 64) on a (dp=2, tp=2) mesh at 0.6x of its unconstrained peak: the joint program
    prices the collectives its recomputed layers run again more than 10% below their cost, so the program with
    the chosen variant fixed is solved too, and its plan (faster by the step simulator) reports the exact price
    of its choice and the joint program's bound. A joint plan that is not solved again reports the exact price
    of its choice too."""
    from autopar.passes import solve_placements as sp
    from autopar.testing.hf_models import MODELS

    torch.manual_seed(0)
    model, args, kwargs = MODELS["bert"](batch=4, seq=16)
    mesh = autopar.fake_mesh(SHAPE, NAMES, "cpu")
    free = compile_plan(model, mesh, args, example_kwargs=kwargs, config=Config(solver=QUIET)).plan
    limit = 0.6 * free.peak_memory_per_rank / 2**30
    comp = compile_plan(model, mesh, args, example_kwargs=kwargs, config=Config(solver=QUIET, memory_limit_gb=limit))
    stats, ctx = comp.ctx.solver_stats, comp.ctx
    assert stats["recompute"] == "joint, repriced" and comp.plan.recomputed_stacks(), (stats, comp.plan.recompute)
    fixed = sp.build_problem(ctx, None)
    assert fixed.objective({k: ctx.choice[k] for k in fixed.n_strategies}) == pytest.approx(stats["objective_s"],
                                                                                            rel=1e-9)
    assert stats["bound_s"] <= stats["objective_s"]
    # Below the threshold the joint plan stands, and reports the exact price of its choice all the same.
    monkeypatch.setattr(sp, "_REPRICE", float("inf"))
    comp = compile_plan(model, mesh, args, example_kwargs=kwargs, config=Config(solver=QUIET, memory_limit_gb=limit))
    stats, ctx = comp.ctx.solver_stats, comp.ctx
    assert stats["recompute"] == "joint" and comp.plan.recomputed_stacks()
    fixed = sp.build_problem(ctx, None)
    exact = fixed.objective({k: ctx.choice[k] for k in fixed.n_strategies})
    assert stats["objective_s"] == pytest.approx(exact, rel=1e-9) and stats["joint_objective_s"] < exact * 0.95
    assert stats["gap"] == pytest.approx(1 - stats["bound_s"] / exact, rel=1e-9)


def _tiny_plan(limit_kib: float | None, recompute: str = "auto") -> Plan:
    torch.manual_seed(0)
    tokens = torch.randint(0, LLAMA_TINY.vocab_size, (8, 64), generator=torch.Generator().manual_seed(1))
    return autopar.plan(Llama(LLAMA_TINY), autopar.fake_mesh((2,), ("dp",), "cpu"), (tokens,), loss_fn=cross_entropy_loss,
                        config=Config(solver=QUIET, recompute=recompute,
                                      memory_limit_gb=None if limit_kib is None else limit_kib * 2**10 / 2**30))


def test_a_plan_from_the_verdicts_search_is_not_reported_as_repriced(monkeypatch):
    """Where the joint solve finds no plan that fits and the plan comes from the search behind the infeasible
    verdict, the solver stats say the joint program chose the variants ("joint"), not that a joint plan was
    solved again with them fixed: the flag had been the list of plans found, empty when tested and filled by
    that search."""
    from autopar.passes import solve_placements as sp
    from autopar.solver.ilp import ProgramInfeasible

    solve_one, calls = sp._solve_one, []

    def first_finds_nothing(ctx, *a, **k):
        calls.append(k.get("start"))
        if len(calls) == 1:
            raise ProgramInfeasible("no plan fits with its gradient buffers")
        return solve_one(ctx, *a, **k)

    monkeypatch.setattr(sp, "_solve_one", first_finds_nothing)
    plan = _tiny_plan(3800)
    assert len(calls) == 2 and calls[1] is not None  # solved again from the plan of least peak
    assert plan.solver_stats["recompute"] == "joint" and plan.peak_memory_per_rank <= 3800 * 2**10


@pytest.mark.slow
def test_the_solver_recomputes_only_where_memory_binds():
    free = _tiny_plan(None)
    assert free.recompute["layers"] == {"variant": "keep", "by": "solver", "time_s": 0.0, "saved_bytes": 0}
    assert "ac" not in free.techniques
    # 3800 KiB on two ranks: no placement alone fits (the smallest peak, its gradient buckets included, is 3.88
    # MiB), recomputing lets one fit.
    with pytest.raises(autopar.InfeasibleMemoryError, match=r"smallest plan found needs 3.88 MiB .*recompute='auto'"):
        _tiny_plan(3800, recompute="off")
    tight = _tiny_plan(3800)
    assert tight.recomputed_stacks() == ["layers"] and tight.recompute["layers"]["by"] == "solver"
    assert tight.peak_memory_per_rank <= 3800 * 2**10
    assert tight.estimated_step_time > free.estimated_step_time
    # Below what any placement and recomputation reach: the error names the smallest peak and what fills it.
    with pytest.raises(autopar.InfeasibleMemoryError,
                       match=r"smallest plan found with recomputation \(layers \w+\) needs 3.03 MiB "
                             r"\(largest consumers: "):
        _tiny_plan(3000)


@pytest.mark.slow  # make test-fast stays within its 3 minutes
def test_saved_tensor_hooks_the_step_does_not_run_are_named():
    """Activation offloading by saved-tensor hooks (save_on_cpu, as transformers' activation_checkpointing_enable(
    offload=True) enters it) does not run in the generated step: planning says so and what to use instead."""
    class Offloaded(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

        def forward(self, x):
            with torch.autograd.graph.save_on_cpu():
                return self.fc2(self.fc1(x).relu()).sum()

    mesh = autopar.fake_mesh(2, "dp", "cpu")
    with pytest.warns(UserWarning, match=r"saved-tensor hooks \(save_on_cpu.*stay on the device.*recompute"):
        autopar.plan(Offloaded(), mesh, (torch.randn(4, 8),), config=Config(solver=QUIET))
    with warnings.catch_warnings():  # without hooks, no warning
        warnings.simplefilter("error")
        autopar.plan(Offloaded().fc1, mesh, (torch.randn(4, 8),), loss_fn=lambda y, *_: y.sum(),
                     config=Config(solver=QUIET))


@pytest.mark.slow
def test_a_selective_policy_of_torchtitans_kind_saves_the_ops_it_names():
    """Layers wrapped as torchtitan wraps them for selective activation checkpointing (checkpoint_wrapper with a
    policy function saving matmuls and attention): those outputs are saved, the rest recomputed, and the plan
    records the stack as selective, by the model."""
    import re

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    saved_ops = (torch.ops.aten.mm.default, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default)

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in saved_ops else CheckpointPolicy.PREFER_RECOMPUTE

    torch.manual_seed(0)
    model = Llama(LLAMA_TINY)
    for i, layer in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(layer, context_fn=functools.partial(create_selective_checkpoint_contexts,
                                                                                  policy), preserve_rng_state=False)
    tokens = torch.randint(0, LLAMA_TINY.vocab_size, (4, 16), generator=torch.Generator().manual_seed(1))
    comp = compile_plan(model, autopar.fake_mesh(SHAPE, NAMES, "cpu"), (tokens,), loss_fn=cross_entropy_loss,
                        config=Config(solver=QUIET, recompute="off"), template_layers=None)
    assert comp.plan.recompute["layers"]["variant"] == "selective" and comp.plan.recompute["layers"]["by"] == "model"
    assert "the model's checkpoint policy saves" in comp.plan.explain("layers"), comp.plan.explain("layers")
    prog = comp.program(RankSpec.fake(NAMES, SHAPE, (0, 1)))
    assert len(prog.recomputed) > len(prog.saved), (len(prog.recomputed), len(prog.saved))
    assert any(v.startswith("add") for v in prog.recomputed), prog.recomputed  # the norms' and residuals' ops
    assert not [v for v in prog.recomputed if re.fullmatch(r"(mm|_scaled_dot_product\w*)(_\d+)?", v)], prog.recomputed


@pytest.mark.slow
def test_a_model_checkpointing_every_other_layer_is_planned_whole_and_reported():
    """transformers' activation_checkpointing_enable(every_n_layers=2): a template of two captured layers would
    stand for the wrong share of checkpointed layers, so the whole model is captured (with a warning); the plan
    counts the model's recomputation and says how many layers the model checkpoints."""
    from autopar.testing.hf_models import MODELS

    torch.manual_seed(0)
    model, args, kwargs = MODELS["llama"](batch=4, seq=16, num_hidden_layers=4)
    model.activation_checkpointing_enable(every_n_layers=2)
    with pytest.warns(UserWarning, match=r"template layers differ \(the model checkpoints model\.layers\.0 only, "
                                         r"of model\.layers\.0 to model\.layers\.1\)"):
        plan = autopar.plan(model, autopar.fake_mesh(SHAPE, NAMES, "cpu"), args, example_kwargs=kwargs,
                            config=Config(solver=QUIET, recompute="off", template_layers=2))
    rc = plan.recompute["model.layers"]
    assert (rc["variant"], rc["by"], rc["model_layers"]) == ("keep", "config", 2), rc
    assert rc["time_s"] > 0 and rc["saved_bytes"] > 0, rc
    assert "ac" in plan.techniques and plan.recomputed_stacks() == ["model.layers"]
    assert "keep, 2 of 4 layers checkpointed by the model" in plan.summary(), plan.summary()


@pytest.mark.slow
def test_the_models_own_checkpointing_is_recorded_as_full_recomputation():
    from autopar.testing.hf_models import MODELS

    torch.manual_seed(0)
    model, args, kwargs = MODELS["llama"](batch=4, seq=16)
    model.gradient_checkpointing_enable()
    comp = compile_plan(model, autopar.fake_mesh(SHAPE, NAMES, "cpu"), args, example_kwargs=kwargs,
                        config=Config(solver=QUIET, recompute="off"), template_layers=None)
    assert comp.plan.recompute["model.layers"]["variant"] == "full"
    assert comp.plan.recompute["model.layers"]["by"] == "model"
    assert comp.plan.recompute["model.layers"]["saved_bytes"] > 0 and comp.plan.recompute["model.layers"]["time_s"] > 0
    prog = comp.program(RankSpec.fake(NAMES, SHAPE, (0, 1)))
    # Each layer saves its input: not a chain back to the first layer, whose input alone would be saved.
    layer_inputs = [s for s in prog.saved if "input_layernorm" in s or "add" in s]
    assert len(prog.recomputed) > len(prog.saved) and layer_inputs, prog.saved


# --- memory truth: the plan's peak against the measured one ------------------------------------------------
def build_small():
    """Llama with 4 layers of width 256 on 8 x 64 tokens: 11 MiB of parameters, about 50 MiB per rank."""
    torch.manual_seed(0)
    tokens = torch.randint(0, LLAMA_SMALL.vocab_size, (8, 64), generator=torch.Generator().manual_seed(1))
    return Llama(LLAMA_SMALL), (tokens,), cross_entropy_loss


def _copies_of_collectives(gm) -> set[str]:
    """Forward values that are a collective's output or data moved from one (a view, a chunk, a cat of them):
    the redistributed copies codegen makes."""
    from autopar import _torch_compat as compat
    from autopar.cost import VIEW_OPS

    moves = VIEW_OPS | {torch.ops.aten.cat, torch.ops.aten.clone, torch.ops.aten.contiguous,
                        torch.ops.aten.chunk, torch.ops.aten.split}
    out: set[str] = set()
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        ins = n.all_input_nodes
        if compat.op_namespace_and_name(n.target)[0] == "_c10d_functional" or (
                ins and getattr(n.target, "overloadpacket", n.target) in moves and all(a.name in out for a in ins)):
            out.add(n.name)
    return out


@pytest.mark.parametrize("recipe", ["megatron", "solver"])
def test_the_backward_saves_no_redistributed_copy(recipe):
    """No saved tensor is a redistributed copy, which the memory model would not count. The Megatron recipe's
    plan saved eight flattened views of four gathered sequence-parallel norm outputs (1.0 MiB uncounted); with the
    second gather priced, its unpinned norm multiply now gathers before the views, and where a view does read a
    gathered copy the backward derives it again (test_a_view_of_a_gathered_activation_is_gathered_again_in_the_backward)."""
    from autopar import recipes
    from autopar.mesh import MeshSpec

    model, inputs, loss_fn = build_small()
    spec = MeshSpec(NAMES, SHAPE, ("loopback", "loopback"), "cpu")
    shapes = {k: tuple(p.shape) for k, p in model.named_parameters()}
    cfg = dict(recipes.recipe(recipe)(shapes, spec, n_inputs=1), recompute="off") if recipe != "solver" else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = compile_plan(model, autopar.fake_mesh(SHAPE, NAMES, "cpu"), inputs, loss_fn=loss_fn,
                            config=Config(solver=QUIET, **cfg)).plan
    for rank in range(4):
        prog = autopar.program(plan, rank, model=model, example_inputs=inputs, loss_fn=loss_fn)
        copies = _copies_of_collectives(prog.forward)
        assert copies, "the plan redistributes activations"
        assert not copies & set(prog.saved), sorted(copies & set(prog.saved))


@functools.lru_cache(maxsize=None)
def gathered_view_compiled():
    """The Megatron plan of the tiny Llama with the MLP's norm output sequence-parallel and its flattened views
    for the w1/w3 matmuls pinned replicated on tp: each view reads a gathered copy, and the backward reads the
    views for the weight gradients."""
    model, inputs, loss_fn = build("llama")
    cfg = _megatron("llama", model, inputs)
    cfg["pins"] = dict(cfg["pins"], **{"act:*ffn_norm/fwd/mul#1": (Shard(0), Shard(1)),
                                       "act:*feed_forward.w1/fwd/view": (Shard(0), R)})
    comp = compile_plan(model, autopar.fake_mesh(SHAPE, NAMES, "cpu"), inputs, loss_fn=loss_fn,
                        config=Config(solver=QUIET, recompute="off", **cfg), template_layers=None)
    again = [label for lane, label, _, _ in comp.ctx.simulation.timeline
             if lane.startswith("comm:") and label.startswith("recompute ") and "feed_forward" in label]
    assert again, "the plan gathers no view's input again in the backward"
    return comp


def step_and_saved_copies(text: str) -> dict:
    """On every rank: the loss and full gradients of one step of the plan, and the saved tensors of its program
    that are redistributed copies."""
    from autopar.testing.dist import cpu_mesh

    model, inputs, loss_fn = build("llama")
    pm = autopar.parallelize(model, cpu_mesh(tuple(SHAPE), tuple(NAMES)), inputs, loss_fn=loss_fn,
                             plan=Plan.from_json(text), seed=0)
    loss = pm(*inputs)
    loss.backward()
    grads = {k: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
             for k, p in pm.named_parameters() if p.grad is not None}
    prog = pm.program()
    return {"loss": loss.detach().clone(), "grads": grads,
            "saved_copies": sorted(_copies_of_collectives(prog.forward) & set(prog.saved)),
            "gathers_again": sum("all_gather" in str(n.target) for n in prog.backward.graph.nodes)}


@pytest.mark.slow
def test_a_view_of_a_gathered_activation_is_gathered_again_in_the_backward():
    """Where a flattened matmul input is a gathered sequence-parallel activation (pinned so), the backward gathers
    it again for the weight gradient instead of saving the gathered copy: on 4 gloo ranks the step's loss and
    gradients are the single device's, and no rank saves a redistributed copy."""
    from autopar.testing.compare import assert_all_close, grad_pairs

    model, inputs, loss_fn = build("llama")
    loss = loss_fn(model(*inputs), *inputs)
    loss.backward()
    want = {k: p.grad for k, p in model.named_parameters()}
    results = get_pool(4).run(step_and_saved_copies, gathered_view_compiled().plan.to_json())
    for res in results:
        assert res["saved_copies"] == [] and res["gathers_again"] > 0, res["saved_copies"]
        assert_all_close([("loss", res["loss"], loss.detach())] + grad_pairs(res["grads"], want))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bert", "opt"])
def test_a_plan_under_half_its_peak_fits_its_figure_when_run(name):
    """Small transformers models planned at half their unconstrained peak and measured on 4 gloo ranks: the
    measured peak is at most the plan's figure, which is at most the limit. The plans recompute, shard weights
    and redistribute activations, so their peaks hold redistributed copies and gathered weights (with their
    bucket's input and the next bucket, prefetched): before the memory rows counted those, BERT's plan measured
    1.047 and OPT's 1.018 of their figures, above their limits."""
    from autopar.testing.memory import build_hf, measure_plan_step

    build = functools.partial(build_hf, name)
    model, args, _, kwargs = build()
    mesh = autopar.fake_mesh(SHAPE, NAMES, "cpu")
    free = autopar.plan(model, mesh, args, example_kwargs=kwargs, config=Config(solver=QUIET))
    limit = 0.5 * free.peak_memory_per_rank
    plan = autopar.plan(model, mesh, args, example_kwargs=kwargs,
                        config=Config(solver=QUIET, memory_limit_gb=limit / 2**30))
    assert plan.peak_memory_per_rank <= limit
    assert {"tp", "ac"} <= set(plan.techniques)
    measured = max(r["peak"] for r in get_pool(4).run(measure_plan_step, build, plan.to_json()))
    assert measured <= plan.peak_memory_per_rank, (measured, plan.peak_memory_per_rank, plan.memory_breakdown)


@pytest.mark.slow
def test_measured_peak_memory_is_at_most_the_plans_and_within_10_percent_of_it():
    """Peak live tensor bytes of a step after a warm-up step (autopar.testing.memory), on every rank, against
    plan.peak_memory_per_rank: the solver's plan with and without recomputation, and the DP, FSDP and Megatron
    recipes. The plan's figure bounds the measured one but for scalar temporaries (a plan that fits a limit fits it
    when it runs), and is within 10% of it (measured 0.94-1.00). The Megatron recipe's sequence-parallel norm outputs are gathered for
    the MLP and viewed flat for its matmuls; the backward reads those views for the weight gradients, and derives
    them again from the saved norm output (gathering it again) rather than saving the gathered copies, which the
    memory model does not count (autopar.recompute.rederived_views; saved, they held 0.38 MiB beyond its
    figure)."""
    from autopar import recipes
    from autopar.compiler import compile_plan
    from autopar.mesh import MeshSpec
    from autopar.testing.memory import measure_plan_step

    pool = get_pool(4)
    model, inputs, loss_fn = build_small()
    spec = MeshSpec(NAMES, SHAPE, ("loopback", "loopback"), "cpu")
    shapes = {k: tuple(p.shape) for k, p in model.named_parameters()}
    kinds = {"solver": {}, "solver, full": {"recompute": "full"}}
    kinds.update({r: dict(recipes.recipe(r)(shapes, spec, n_inputs=1), recompute="off")
                  for r in ("ddp", "fsdp", "megatron")})
    rows = []
    for kind, cfg in kinds.items():
        comp = compile_plan(model, autopar.fake_mesh(SHAPE, NAMES, "cpu"), inputs, loss_fn=loss_fn,
                            config=Config(solver=QUIET, **cfg))
        plan = comp.plan
        assert plan.peak_memory_per_rank > 10 * 2**20
        measured = max(r["peak"] for r in pool.run(measure_plan_step, build_small, plan.to_json()))
        rows.append((kind, plan.peak_memory_per_rank, measured))
    # The model counts no scalar temporaries (the loss, its gradient, token counts): up to a few hundred bytes of
    # them were measured beyond the Megatron plan's figure, which its copies now make exact to within them.
    bad = [r for r in rows if not 0.9 * r[1] <= r[2] <= r[1] + SCALARS]
    assert not bad, [(k, f"predicted {p / 2**20:.2f} MiB, measured {m / 2**20:.2f} MiB") for k, p, m in rows]
    # Recomputation lowers the measured peak as it lowers the predicted one.
    by = {k: m for k, _, m in rows}
    assert by["solver, full"] < by["solver"]
