"""Pipeline parallelism: plans over a mesh axis named pp (stage cuts, schedule, microbatches) and stage Programs
run on torch.distributed.pipelining over gloo, equal to the one-device step on a padded batch."""
from __future__ import annotations

import dataclasses
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
from autopar.models import LLAMA_TINY, Llama
from autopar.plan import Plan
from autopar.testing.dist import get_pool

R = Replicate()
QUIET = SolverConfig(show_progress=False)


class LM(Llama):
    """The example Llama called with (tokens, labels)."""

    def forward(self, tokens, labels):
        return super().forward(tokens)


def lm_loss(logits, tokens, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


def hf_llama(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      attention_dropout=0.0, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg)


def build(name: str):
    """(model, args, kwargs, loss_fn): a batch of 8 rows whose padding (label -100) leaves one microbatch of 2
    rows without a counted token and others partly padded."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    if name.startswith("llama"):
        layers = int(name.split(":")[1])
        model = LM(dataclasses.replace(LLAMA_TINY, n_layers=layers))
        tokens = torch.randint(0, 256, (8, 16), generator=gen)
        labels = torch.randint(0, 256, (8, 16), generator=gen)
        labels[0:2, 3:] = -100
        labels[2:4] = -100
        labels[5, 10:] = -100
        return model, (tokens, labels), {}, lm_loss
    from autopar.testing.hf_models import padded

    model = hf_llama(int(name.split(":")[1]))
    ids = torch.randint(0, 128, (8, 16), generator=gen)
    mask, labels = padded(ids, [16, 3, 0, 0, 16, 10, 16, 7])
    return model, (ids,), {"attention_mask": mask, "labels": labels}, None


MESHES = {"pp2": ((2,), ("pp",)), "pp4": ((4,), ("pp",)), "pp2xtp2": ((2, 2), ("pp", "tp")),
          "pp2xdp2": ((2, 2), ("pp", "dp")), "pp2xdp2xtp2": ((2, 2, 2), ("pp", "dp", "tp"))}


def _pins(names: tuple[str, ...]) -> dict:
    """Megatron on tp, FSDP on dp, so the collectives inside stages run."""
    def lay(tp=R, dp=R):
        return tuple({"tp": tp, "dp": dp}.get(a, R) for a in names)

    dp = Shard(0) if "dp" in names else R
    pins = {p: lay(tp=Shard(0), dp=dp) for p in ("*.w1.weight", "*.w3.weight", "*.wq.weight", "*.wk.weight",
                                                   "*.wv.weight", "*.gate_proj.weight", "*.up_proj.weight",
                                                   "*.q_proj.weight", "*.k_proj.weight", "*.v_proj.weight")}
    pins.update({p: lay(tp=Shard(1), dp=dp) for p in ("*.w2.weight", "*.wo.weight", "*.down_proj.weight",
                                                       "*.o_proj.weight")})
    pins["*"] = lay(dp=dp)
    return pins


@functools.lru_cache(maxsize=None)
def plan_json(name: str, mesh: str, schedule: str | None, microbatches: int | None) -> str:
    model, args, kwargs, loss_fn = build(name)
    shape, names = MESHES[mesh]
    config = Config(microbatches=microbatches, pipeline_schedule=schedule, solver=QUIET,
                    pins=_pins(names) if len(names) > 1 else None)
    if "dp" in names:
        config = config.with_(input_placements={i: tuple(Shard(0) if a == "dp" else R for a in names)
                                                for i in range(len(args) + len(kwargs))})
    comp = compile_plan(model, autopar.fake_mesh(shape, names, "cpu"), args, example_kwargs=kwargs, loss_fn=loss_fn,
                        config=config, template_layers=None)
    return comp.plan.to_json()


# --- what the workers run -----------------------------------------------------------------------------------
def train_pipelined(name: str, mesh: str, plan: str, mutate: str = "") -> dict:
    from autopar.testing.dist import cpu_mesh

    import autopar.runtime.pipeline as rp

    model, args, kwargs, loss_fn = build(name)
    shape, names = MESHES[mesh]
    pm = autopar.parallelize(model, cpu_mesh(tuple(shape), tuple(names)), args,
                             example_kwargs=kwargs, loss_fn=loss_fn, plan=Plan.from_json(plan))
    calls = {"input": 0, "weight": 0}
    for runner in pm._pipeline.runners:
        for kind in calls:
            fn = getattr(runner, f"backward_{kind}")

            def counted(*a, _fn=fn, _kind=kind):
                calls[_kind] += 1
                return _fn(*a)
            setattr(runner, f"backward_{kind}", counted)
        if mutate == "drop_input_grads":  # negative control: send zeros back instead of the input gradients
            full = runner.backward
            runner.backward = lambda k, saved, grads, _f=full: tuple(torch.zeros_like(g) for g in _f(k, saved, grads))
    local = {f for prog in pm.stage_programs() for f in prog.param_names}
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, eps=1e-6)
    out = {"losses": []}
    for step in range(2):
        opt.zero_grad()
        out["losses"].append(pm.step(*args, **kwargs).item())
        if step == 0:
            out["grads"] = {k: p.grad.full_tensor() for k, p in pm.named_parameters() if k in local}
        opt.step()
    out["weights"] = {k: p.full_tensor().detach() for k, p in pm.named_parameters() if k in local}
    out["calls"] = calls
    out["stages"] = [p.stage for p in pm.stage_programs()]
    try:
        pm(*args, **kwargs)
    except ValueError as e:
        out["call_error"] = str(e)
    del rp
    return out


@functools.lru_cache(maxsize=None)
def reference(name: str) -> dict:
    model, args, kwargs, loss_fn = build(name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    out = {"losses": []}
    for step in range(2):
        opt.zero_grad()
        res = model(*args, **kwargs)
        loss = loss_fn(res, *args, **kwargs) if loss_fn else res.loss
        loss.backward()
        out["losses"].append(loss.item())
        if step == 0:
            out["grads"] = {k: p.grad.clone() for k, p in model.named_parameters()}
        opt.step()
    out["weights"] = {k: p.detach().clone() for k, p in model.named_parameters()}
    return out


def _close(a, b, what):
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m: f"{what}: {m}")


def run_and_check(name: str, mesh: str, schedule: str | None, microbatches: int | None) -> list[dict]:
    shape, names = MESHES[mesh]
    pool = get_pool(math.prod(shape))
    plan = plan_json(name, mesh, schedule, microbatches)
    pp = Plan.from_json(plan).pipeline
    assert pp is not None and pp.stages >= shape[0]
    if schedule:
        assert pp.schedule == schedule
    results = pool.run(train_pipelined, name, mesh, plan)
    ref = reference(name)
    grads, weights = {}, {}
    for rank, r in enumerate(results):
        _close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), f"losses on rank {rank}")
        grads.update(r["grads"])
        weights.update(r["weights"])
        assert "pm.step" in r["call_error"]
    assert set(grads) == set(ref["grads"])
    for k in ref["grads"]:
        _close(grads[k], ref["grads"][k], f"grad of {k}")
        _close(weights[k], ref["weights"][k], f"{k} after 2 AdamW steps")
    return results


SCHEDULES = ["ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble",
             "ScheduleZBVZeroBubble"]


FAST_SCHEDULES = {"Schedule1F1B", "ScheduleZBVZeroBubble"}  # the rest run in `make test`


@pytest.mark.parametrize("schedule", [pytest.param(s, marks=() if s in FAST_SCHEDULES else pytest.mark.slow)
                                      for s in SCHEDULES])
def test_every_schedule_on_two_stages_equals_one_device(schedule):
    results = run_and_check("llama:4", "pp2", schedule, 4)
    split = schedule in ("ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble")
    # Zero-bubble schedules run the split backward (input gradients, then weight gradients); the others never.
    assert (sum(r["calls"]["input"] for r in results) > 0) == split
    assert (sum(r["calls"]["weight"] for r in results) > 0) == split


def test_sending_wrong_input_gradients_is_caught():
    """Negative control: a stage that sends zeros back instead of its input gradients fails the comparison."""
    shape, names = MESHES["pp2"]
    got = get_pool(2).run(train_pipelined, "llama:4", "pp2", plan_json("llama:4", "pp2", "Schedule1F1B", 4),
                          "drop_input_grads")
    ref = reference("llama:4")
    first = next(r for r in got if 0 in r["stages"])
    with pytest.raises(AssertionError):
        _close(first["grads"]["layers.0.attention.wq.weight"], ref["grads"]["layers.0.attention.wq.weight"], "grad")


@pytest.mark.parametrize("name,mesh,schedule,m", [
    ("llama:4", "pp2xtp2", "Schedule1F1B", 4),
    ("llama:4", "pp2xdp2", "ScheduleZBVZeroBubble", 4),
    ("llama:4", "pp4", "Schedule1F1B", 8),
    ("hf_llama:4", "pp2", None, None),
])
@pytest.mark.slow
def test_pipeline_with_tensor_and_data_parallel_stages_equals_one_device(name, mesh, schedule, m):
    results = run_and_check(name, mesh, schedule, m)
    assert {s for r in results for s in r["stages"]} == set(range(Plan.from_json(
        plan_json(name, mesh, schedule, m)).pipeline.stages))


@pytest.mark.slow
def test_pipeline_data_and_tensor_parallel_on_eight_processes():
    run_and_check("llama:4", "pp2xdp2xtp2", "ScheduleInterleaved1F1B", 4)


# --- planning, one process ----------------------------------------------------------------------------------
def test_plan_records_stages_schedule_and_microbatches():
    p = Plan.from_json(plan_json("llama:4", "pp2", "ScheduleInterleaved1F1B", 4))
    pp = p.pipeline
    assert (pp.axis, pp.ranks, pp.stages, pp.virtual_stages, pp.microbatches) == ("pp", 2, 4, 2, 4)
    assert pp.stage_ranks == [0, 1, 0, 1]
    assert pp.stage_layers == [[0, 1], [1, 2], [2, 3], [3, 4]]
    assert pp.stage_modules[0][0] == "tok_embeddings" and pp.stage_modules[-1][-2:] == ["norm", "output"]
    assert "pp" in p.techniques and p.microbatches == 4
    assert 0 < pp.bubble_fraction < 1 and pp.timeline
    assert {s["schedule"] for s in pp.schedules} == {"ScheduleInterleaved1F1B"}
    assert Plan.from_json(p.to_json()) == p
    assert "ScheduleInterleaved1F1B" in p.summary() and "tok_embeddings, layers.0" in p.summary()


def test_the_planner_weighs_every_schedule_and_microbatch_count():
    model, args, kwargs, loss_fn = build("llama:4")
    p = autopar.plan(model, autopar.fake_mesh((2,), ("pp",), "h100"), args, loss_fn=loss_fn,
                     config=Config(solver=QUIET))
    names = {s["schedule"] for s in p.pipeline.schedules}
    assert names == set(SCHEDULES)
    best = min(p.pipeline.schedules, key=lambda s: s["step_time_s"])
    assert best["schedule"] == p.pipeline.schedule
    assert p.microbatches in (2, 4, 8) and p.pipeline.microbatches == p.microbatches


def test_bad_pipelines_say_what_to_change():
    model, args, kwargs, loss_fn = build("llama:4")
    with pytest.raises(ValueError, match="the 'pp' axis has 8 stages but the model has 4 layers"):
        autopar.plan(model, autopar.fake_mesh((8,), ("pp",), "cpu"), args, loss_fn=loss_fn,
                     config=Config(microbatches=8, solver=QUIET))
    with pytest.raises(ValueError, match="microbatches=3 does not divide the batch"):
        autopar.plan(model, autopar.fake_mesh((2,), ("pp",), "cpu"), args, loss_fn=loss_fn,
                     config=Config(microbatches=3, solver=QUIET))
    mlp = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    with pytest.raises(ValueError, match="no repeated layers"):
        autopar.plan(mlp, autopar.fake_mesh((2,), ("pp",), "cpu"), (torch.randn(8, 8),),
                     loss_fn=lambda o, x: o.mean(), config=Config(microbatches=2, solver=QUIET))
    with pytest.raises(ValueError, match="pipeline_schedule"):
        Config(pipeline_schedule="PipeDream")


# --- goldens ------------------------------------------------------------------------------------------------
def _plan_llama(cfg, shape, names, batch, seq, **config):
    from autopar.models import cross_entropy_loss

    with torch.device("meta"):
        model = Llama(cfg)
    config = {"memory_limit_gb": 1e6, **config}
    return autopar.plan(model, autopar.fake_mesh(shape, names, "h100"), (torch.zeros(batch, seq, dtype=torch.long),),
                        loss_fn=cross_entropy_loss, config=Config(device="h100", solver=QUIET, **config))


@pytest.mark.slow
def test_golden_405b_on_512_h100_runs_a_schedule_better_than_1f1b_on_balanced_stages():
    from autopar.models.llama import LLAMA3_405B

    p = _plan_llama(LLAMA3_405B, (8, 8, 8), ("pp", "dp", "tp"), 64, 8192, memory_limit_gb=80)
    # 80 GB per rank: stages of 16 layers with their microbatches in flight fit only by recomputing.
    assert p.peak_memory_per_rank <= 80 * 2**30 and max(p.pipeline.memory_per_rank) <= 80 * 2**30
    assert p.recomputed_stacks() == ["layers"] and {"pp", "ac"} <= p.techniques, p.recompute
    pp = p.pipeline
    ranking = [s["schedule"] for s in pp.schedules]
    assert pp.schedule in ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble")
    assert ranking.index(pp.schedule) < ranking.index("Schedule1F1B")
    assert max(pp.stage_time_s) / min(pp.stage_time_s) <= 1.15
    assert {"pp", "tp"} <= p.techniques


@pytest.mark.slow
def test_golden_auto_pipelines_405b_on_64_x_8_h100():
    from autopar.models.llama import LLAMA3_405B

    p = _plan_llama(LLAMA3_405B, (64, 8), ("dp", "tp"), 64, 8192, pipeline="auto")
    assert p.pipeline is not None and "pp" in p.techniques
    assert p.mesh.axis_names[0] == "pp" and p.mesh.size == 512


@pytest.mark.slow
def test_golden_auto_leaves_a_model_that_fits_and_runs_fastest_without_stages_unpipelined():
    from autopar.models import LLAMA_SMALL

    p = _plan_llama(LLAMA_SMALL, (4,), ("dp",), 64, 256, pipeline="auto")
    assert p.pipeline is None and "pp" not in p.techniques
    assert tuple(p.mesh.axis_names) == ("dp",)


def test_a_stage_program_prints_what_it_receives_and_sends():
    plan = Plan.from_json(plan_json("llama:4", "pp2", "Schedule1F1B", 4))
    model, args, kwargs, loss_fn = build("llama:4")
    prog = autopar.program(plan, 1, model=model, example_inputs=args, loss_fn=loss_fn)
    assert prog.stage == 1 and prog.activations_in and not prog.activations_out
    text = str(prog)
    assert "stage        1 of 2 (Schedule1F1B, 4 microbatches): receives activation/0 [2, 16, 64], sends the loss" in text
    assert "# grad_sync" in text
