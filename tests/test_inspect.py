"""Plan inspection on real plans of a small Llama: the table, summary, explain, diff and techniques."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import autopar
from autopar.inspect import diff, explain, format_plan, format_summary, techniques
from autopar.models.llama import Llama, LlamaConfig, cross_entropy_loss
from autopar.plan import Plan
from autopar.recipes import RecipeError, ddp, fsdp_tp, glob_of, hsdp, megatron, plan_recipe

# Two layers, widths large enough that the planner allows feature sharding (it drops shards under 128 elements).
CFG = LlamaConfig(dim=512, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=2048, ffn_dim=2048, max_seq_len=128,
                  rope_theta=10000.0)
BLOCK_PARAMS = ["attention.wq.weight", "attention.wk.weight", "attention.wv.weight", "attention.wo.weight",
                "feed_forward.w1.weight", "feed_forward.w2.weight", "feed_forward.w3.weight", "attention_norm.weight",
                "ffn_norm.weight"]


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model = Llama(CFG)
    mesh = autopar.fake_mesh((2, 2), ("dp", "tp"))
    inputs = (torch.zeros(8, CFG.max_seq_len, dtype=torch.long),)
    return model, mesh, inputs


@pytest.fixture(scope="module")
def plans(setup):
    model, mesh, inputs = setup
    config = autopar.Config(device="h100", links={"dp": "ib", "tp": "nvlink"})
    return {"solver": autopar.plan(model, mesh, inputs, loss_fn=cross_entropy_loss, config=config),
            **{name: plan_recipe(name, model, mesh, inputs, loss_fn=cross_entropy_loss, config=config, quiet=True)
               for name in ("ddp", "megatron")}}


def test_table_has_header_params_collectives_and_costs(plans):
    text = str(plans["megatron"])
    assert "\x1b" not in text  # plain text when not printing to a terminal
    for needle in ("mesh", "dp=2 (ib) x tp=2 (nvlink) = 4 ranks", "h100", "step time", "peak memory",
                   "techniques", "layers.* (x2)", "(top level)", "Main collectives", "Time per step",
                   "Memory per rank", "recipe", "megatron"):
        assert needle in text, needle
    lines = text.splitlines()
    for name in BLOCK_PARAMS + ["tok_embeddings.weight", "output.weight", "norm.weight"]:
        assert any(line.split()[:1] == [name] for line in lines), name
    row = next(line for line in lines if line.split()[:1] == ["attention.wq.weight"])
    assert "dp=R tp=S(0)" in row and "262K" in row  # 512 x 512, colwise over tp
    row = next(line for line in lines if line.split()[:1] == ["feed_forward.w2.weight"])
    assert "dp=R tp=S(1)" in row
    assert "[tp]" in text  # collective steps keep their axis (no markup eaten)


def test_summary_is_short(plans):
    s = format_summary(plans["ddp"])
    assert len(s.splitlines()) <= 8
    assert "techniques: dp" in s and "dp=R tp=R" in s


def test_explain_param_lists_alternatives(plans):
    p = plans["solver"]
    text = explain(p, "layers.1.feed_forward.w1.weight")
    assert text.startswith("parameter layers.*.feed_forward.w1.weight")
    assert "placement" in text and "per rank" in text and "why:" in text
    alts = p.nodes["param/layers.*.feed_forward.w1.weight"].alternatives
    assert len(alts) >= 2
    assert "Alternatives" in text and "vs chosen" in text
    for a in alts:
        assert a["strategy"] in text
    assert explain(p, "feed_forward.w1") == text == p.explain("param/layers.0.feed_forward.w1.weight")


def test_explain_pinned_param_and_node(plans):
    text = explain(plans["megatron"], "layers.0.attention.wq.weight")
    assert "only legal layout" in text and "dp=R tp=S(0)" in text
    node = explain(plans["solver"], "layers.0.feed_forward.w1/fwd/mm")
    assert node.startswith("node layers.*.feed_forward.w1/fwd/mm")
    assert "aten.mm" in node and "compute" in node and "Alternatives" in node


def test_explain_unknown_and_ambiguous_names(plans):
    with pytest.raises(ValueError, match="neither a parameter nor a node.*did you mean"):
        explain(plans["solver"], "layers.0.feed_forward.w9.weight")
    with pytest.raises(ValueError, match="matches 4 parameters"):
        explain(plans["solver"], "attention")


def test_diff_shows_changed_params_and_deltas(plans):
    text = diff(plans["ddp"], plans["megatron"])
    assert "step time" in text and "peak memory" in text and "->" in text
    assert "Parameters placed differently: 7 of 12" in text
    row = next(line for line in text.splitlines() if line.startswith(" layers.*.attention.wo.weight"))
    assert "dp=R tp=R" in row and "dp=R tp=S(1)" in row
    assert "placed the same" in plans["ddp"].diff(plans["ddp"])


def test_techniques(plans):
    assert plans["ddp"].techniques == {"dp"}
    assert {"tp", "dp"} <= plans["megatron"].techniques
    assert "fsdp" not in plans["megatron"].techniques
    # FSDP: shard every parameter over the batch axes of the DDP plan (its batch spans both axes).
    p = plans["ddp"]
    sharded = dataclasses.replace(p, params={k: (Shard(0), Shard(0)) for k in p.params})
    assert techniques(sharded) == {"fsdp"}


def test_json_round_trip_preserves_text(plans):
    for p in plans.values():
        q = Plan.from_json(p.to_json())
        assert not hasattr(q, "simulation")
        assert str(q) == str(p)
        assert q.summary() == p.summary()
        assert explain(q, "layers.0.attention.wo.weight") == explain(p, "layers.0.attention.wo.weight")
    assert diff(Plan.from_json(plans["ddp"].to_json()), plans["megatron"]) == diff(plans["ddp"], plans["megatron"])


def test_format_hand_built_plan_without_optional_fields(plans):
    p = plans["ddp"]
    bare = dataclasses.replace(p, blocks={}, param_numel={}, transitions=[], memory_limit=0, solver_stats={})
    text = format_plan(bare)
    assert "(top level)" in text and "Collectives: none" in text
    assert "layers.*.attention.wq.weight" in text


def test_recipe_pins():
    mesh = autopar.mesh.MeshSpec(("dp", "tp"), (2, 4), ("ib", "nvlink"))
    shapes = {"tok_embeddings.weight": (1024, 256), "layers.0.attention.wq.weight": (256, 256),
              "layers.1.attention.wq.weight": (256, 256), "layers.0.feed_forward.w2.weight": (256, 1024),
              "layers.0.ffn_norm.weight": (256,)}
    assert glob_of("layers.10.attention.wq.weight") == "layers.*.attention.wq.weight"
    r = ddp(shapes, mesh)
    assert set(r["pins"]["layers.*.attention.wq.weight"]) == {Replicate()}
    assert r["input_placements"] == {0: (Shard(0), Replicate())}
    m = megatron(shapes, mesh)["pins"]
    assert m["layers.*.attention.wq.weight"] == (Replicate(), Shard(0))
    assert m["layers.*.feed_forward.w2.weight"] == (Replicate(), Shard(1))
    assert m["tok_embeddings.weight"] == (Replicate(), Replicate())
    f = fsdp_tp(shapes, mesh)["pins"]
    assert f["layers.*.attention.wq.weight"] == (Shard(1), Shard(0))  # data axis takes the dim tp left alone
    assert f["layers.*.ffn_norm.weight"] == (Shard(0), Replicate())
    with pytest.raises(RecipeError, match="two data axes"):
        hsdp(shapes, mesh)
    with pytest.raises(RecipeError, match="no Llama-style projections"):
        megatron({"fc.weight": (8, 8)}, mesh)


@pytest.mark.slow
def test_python_api_mirrors_the_cli(tmp_path):
    """plan.compare, plan.report and autopar.program work on a plan as on its JSON copy; a plan of a live model
    asks for the model."""
    import torch

    import autopar
    from autopar.models.llama import LLAMA_TINY, Llama, cross_entropy_loss

    model, inputs = Llama(LLAMA_TINY), (torch.zeros(4, 16, dtype=torch.long),)
    p = autopar.plan(model, autopar.fake_mesh((2, 2), ("dp", "tp"), device_type="cpu"), inputs,
                     loss_fn=cross_entropy_loss, config=autopar.Config(solver=autopar.SolverConfig(show_progress=False)))
    loaded = autopar.Plan.from_json(p.to_json())
    assert loaded == p and loaded.digest() == p.digest() and str(loaded) == str(p)
    for q in (p, loaded):
        with pytest.raises(ValueError, match=r"made in Python from a live autopar\.models\.llama\.Llama.*"
                                             r"plan\.compare\(model, example_inputs\)"):
            q.compare()
        result = q.compare(model, inputs, recipes=["ddp", "megatron"], loss_fn=cross_entropy_loss)
        assert [r.name for r in result.rows] == ["autopar", "ddp", "megatron"]
        assert result.rows[0].plan is q and "megatron" in result.table()
        q.report(str(tmp_path / "r.html"))
        assert (tmp_path / "r.html").read_text().count("data:image/png;base64,") >= 3
        prog = autopar.program(q, 3, model=model, example_inputs=inputs, loss_fn=cross_entropy_loss)
        assert prog.rank.coords == (1, 1) and "rank         3 of 4" in str(prog)
