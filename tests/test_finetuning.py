"""Models as users fine-tune them: transformers models called with padded batches (attention_mask, labels of -100
on the padding, position_ids), with frozen (and tied) weights, with the library's own gradient checkpointing;
and a convolutional network whose batch norm statistics the step updates. Each trains on a (2, 2) gloo mesh
under a plan that shards weights, equal to one device: losses, gradients, weights and buffers."""
from __future__ import annotations

import functools
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard
from torch.utils.checkpoint import create_selective_checkpoint_contexts

import autopar
from autopar.config import Config, SolverConfig
from autopar.plan import Plan
from autopar.testing.dist import get_pool
from autopar.testing.hf_models import MODELS, padded

pytest.importorskip("transformers")

QUIET = SolverConfig(show_progress=False)
SHAPE, NAMES = (2, 2), ("dp", "tp")
STEPS, LR = 3, 1e-3
LENGTHS = [16, 11, 16, 7]  # real tokens per row; the rest is right padding


class Finetune(nn.Module):
    """What a fine-tuning loop calls: model(ids, attention_mask=..., labels=..., position_ids=...).loss."""

    def __init__(self, model: nn.Module, positions: bool):
        super().__init__()
        self.model = model
        self.positions = positions

    def forward(self, ids, attention_mask, labels):
        extra = {"position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0)} if self.positions else {}
        return self.model(ids, attention_mask=attention_mask, labels=labels, **extra).loss


class Labeled(nn.Module):
    """model(inputs, labels=labels).loss, for the vision and audio models."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x, labels):
        return self.model(x, labels=labels).loss


class CNN(nn.Module):
    """Conv + BatchNorm + ReLU blocks (no conv bias: batch norm subtracts it), a pooled linear head, cross-entropy
    inside forward."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Conv2d(a, b, 3, padding=1, bias=False), nn.BatchNorm2d(b), nn.ReLU())
                                      for a, b in ((3, 8), (8, 16), (16, 16))])
        self.head = nn.Linear(16, 10)

    def forward(self, x, y):
        return F.cross_entropy(self.head(self.blocks(x).mean((2, 3))), y)


# name -> (model builder, features): pad (padded batch), freeze (embeddings and query projections frozen),
# ckpt / ackpt (gradient_checkpointing_enable / activation_checkpointing_enable), ackpt2 (every other layer), sac
# (activation checkpointing with a selective policy saving the matmuls' outputs), lora (PEFT's LoRA adapters on the
# query and value projections, every other weight frozen), recipe (the sharded plan)
CASES = {
    # LoRA with selective checkpointing, as a LoRA fine-tuning script turns both on
    "llama": ("llama", {"pad", "sac", "lora"}, "fsdp"),
    "qwen2": ("qwen2", {"pad", "freeze", "ckpt"}, "megatron"),  # tied embeddings, frozen
    "gpt_neox": ("gpt_neox", {"pad", "ckpt"}, "fsdp"),
    "opt": ("opt", {"pad", "freeze"}, "fsdp"),  # tied embeddings, frozen
    "phi3": ("phi3", {"pad", "ackpt2"}, "fsdp"),
    "falcon": ("falcon", {"pad", "freeze"}, "fsdp"),
    "bert": ("bert", {"pad"}, "fsdp"),
    "t5": ("t5", {"pad"}, "fsdp"),
    "cnn": ("cnn", set(), "sync-bn"),  # data parallel over both axes: batch norm needs global statistics
    # vision and audio: convolutions, batch norm (ResNet), layer norm over channels (ConvNeXt), an encoder-decoder
    "resnet": ("resnet", set(), "fsdp"),
    "convnext": ("convnext", set(), "fsdp"),
    "wav2vec2": ("wav2vec2", set(), "fsdp"),
    "whisper": ("whisper", set(), "fsdp"),
}
FROZEN = ("embed", "wte", "word_embeddings", "q_proj", "query_key_value", "q.weight", "query.weight")


def build(case: str):
    """(model, example inputs, frozen parameter names), identical on every process."""
    kind, features, _ = CASES[case]
    torch.manual_seed(0)
    if kind == "cnn":
        gen = torch.Generator().manual_seed(1)
        return CNN(), (torch.randn(8, 3, 8, 8, generator=gen), torch.randint(0, 10, (8,), generator=gen)), []
    if kind in ("resnet", "convnext", "wav2vec2", "whisper"):
        model, args, kwargs = MODELS[kind](batch=4)
        return Labeled(model), (*args, kwargs["labels"]), []
    model, args, _ = MODELS[kind](batch=4, seq=16)
    ids = args[0]
    mask, labels = padded(ids, LENGTHS)
    frozen = []
    if "lora" in features:  # as a LoRA fine-tuning script wraps the model (dropout off: masks differ from one device's)
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                 lora_dropout=0.0))
        frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    if "freeze" in features:
        for n, p in model.named_parameters(remove_duplicate=False):
            if any(f in n for f in FROZEN):
                p.requires_grad_(False)
                frozen.append(n)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # gradient_checkpointing_enable is a deprecated alias
        if "ckpt" in features:
            model.gradient_checkpointing_enable()
        if "ackpt" in features:
            model.activation_checkpointing_enable()
        if "ackpt2" in features:  # every other layer (the first of each pair) checkpointed
            model.activation_checkpointing_enable(every_n_layers=2)
        if "sac" in features:
            policy = functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])
            model.activation_checkpointing_enable({"use_reentrant": False, "context_fn": policy})
    positions = kind not in ("bert", "t5", "opt")
    return Finetune(model, positions), (ids, mask, labels), frozen


@functools.lru_cache(maxsize=None)
def plan_json(case: str) -> str:
    from autopar.recipes import plan_recipe

    model, inputs, _ = build(case)
    mesh, config = autopar.fake_mesh(SHAPE, NAMES, "cpu"), Config(solver=QUIET, template_layers=None)
    if CASES[case][2] == "sync-bn":  # weights sharded (FSDP), convolutions on batch shards over every rank
        batch = (Shard(0), Shard(0))
        config = config.with_(pins={"blocks.*.weight": batch, "act:*/fwd/convolution": batch},
                              input_placements={0: batch, 1: batch})
        return autopar.plan(model, mesh, inputs, config=config).to_json()
    return plan_recipe(CASES[case][2], model, mesh, inputs, config=config, quiet=True).to_json()


def train_steps(call, model, inputs, steps: int = STEPS) -> tuple[dict, torch.optim.Optimizer]:
    """({"losses", first step's "grads"}, the optimizer) of `steps` AdamW steps of call(*inputs) over `model`'s
    trainable parameters; the optimizer is made after the first call, as the torch.compile backend asks."""
    out = {"losses": []}
    loss = call(*inputs)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, eps=1e-6)
    for step in range(steps):
        if step:
            opt.zero_grad()
            loss = call(*inputs)
        loss.backward()
        if step == 0:
            out["grads"] = {k: None if p.grad is None else _full(p.grad) for k, p in model.named_parameters()}
        opt.step()
        out["losses"].append(loss.item())
    return out, opt


def _train(model, inputs, distributed: bool) -> dict:
    out, opt = train_steps(model, model, inputs)
    out["state"] = {k: _full(v) for k, v in (model.full_state_dict() if distributed else model.state_dict()).items()}
    out["optimizer_state"] = sorted(k for k, p in model.named_parameters() if p in opt.state)
    model.eval()
    with torch.no_grad():
        out["eval_loss"] = model(*inputs).item()
    return out


def _full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def train_parallel(case: str, plan: str) -> dict:
    from autopar.testing.dist import cpu_mesh

    model, inputs, _ = build(case)
    pm = autopar.parallelize(model, cpu_mesh(tuple(SHAPE), tuple(NAMES)), inputs,
                             plan=Plan.from_json(plan))
    prog = pm.program()
    res = _train(pm, inputs, distributed=True)
    res["reduced"] = sorted({n for c in prog.collectives if c.graph == "backward" for n in c.bucket})
    res["recomputed"], res["saved"] = len(prog.recomputed), len(prog.saved)
    return res if torch.distributed.get_rank() == 0 else {"losses": res["losses"]}


@functools.lru_cache(maxsize=None)
def reference(case: str) -> dict:
    model, inputs, _ = build(case)
    return _train(model, inputs, distributed=False)


def _close(got, want, what, floor: float = 1e-9):
    """Per-tensor tolerance, relative to the tensor's own magnitude so small gradients are checked too, down to
    `floor`: a millionth of the largest tensor of its kind. Below that sit gradients that are zero in exact
    arithmetic (a key projection's bias under softmax), whose values are rounding noise of sums taken in
    another order; a dropped or misrouted collective moves values by far more."""
    scale = want.abs().max().item() if want.numel() else 0.0
    torch.testing.assert_close(got, want, rtol=1e-4, atol=max(1e-4 * scale, floor), msg=lambda m: f"{what}: {m}")


def _floor(tensors) -> float:
    return 1e-6 * max((t.abs().max().item() for t in tensors if t is not None and t.numel()), default=1.0)


def check_losses_and_grads(results: list[dict], ref: dict) -> None:
    """Every rank's losses and rank 0's first gradients against one device's (a frozen weight gets none)."""
    for rank, r in enumerate(results):
        _close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), f"losses on rank {rank}")
    got = results[0]
    assert set(got["grads"]) == set(ref["grads"])
    floor = _floor(ref["grads"].values())
    for k, g in ref["grads"].items():
        if g is None:
            assert got["grads"][k] is None, f"{k} is frozen but got a gradient"
        else:
            _close(got["grads"][k], g, f"grad of {k}", floor)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_trains_like_one_device(case):
    pool = get_pool(math.prod(SHAPE))
    plan = Plan.from_json(plan_json(case))
    sharded = [k for k, lay in plan.params.items() if any(isinstance(p, Shard) for p in lay)]
    assert sharded, f"the {CASES[case][2]} plan of {case} shards no weight"
    if case == "cnn":  # every batch norm sees a quarter of the batch and all-reduces its statistics
        assert plan.batch_norms == {f"blocks.{i}.1": "global over dp+tp" for i in range(3)}, plan.batch_norms
    results = pool.run(train_parallel, case, plan.to_json())
    ref, got = reference(case), results[0]
    check_losses_and_grads(results, ref)
    _close(torch.tensor(got["eval_loss"]), torch.tensor(ref["eval_loss"]), "eval-mode loss after training")
    assert set(got["state"]) == set(ref["state"])  # every parameter and buffer, none dropped
    floor = _floor(v.float() for v in ref["state"].values())
    for k, v in ref["state"].items():
        _close(got["state"][k].to(v.dtype), v, f"{k} after {STEPS} steps", floor)
    assert got["optimizer_state"] == ref["optimizer_state"]
    _, inputs, frozen = build(case)
    if frozen:  # no gradient collective carries a frozen weight
        assert not set(frozen) & set(got["reduced"]), set(frozen) & set(got["reduced"])
    if CASES[case][1] & {"ckpt", "ackpt", "sac"}:
        assert got["recomputed"] > got["saved"], (got["recomputed"], got["saved"])
    if "ackpt2" in CASES[case][1]:  # the first of the two layers recomputed, the other keeping its activations
        assert [d.get("model_layers") for d in plan.recompute.values()] == [1], plan.recompute
        assert got["recomputed"] > 0, got["recomputed"]
    if "sac" in CASES[case][1]:  # the policy's saved matmuls are kept, the rest of each layer recomputed
        assert {v["variant"] for v in plan.recompute.values()} == {"selective"}, plan.recompute


@pytest.mark.slow
def test_checkpointed_layers_are_recomputed_not_saved():
    """activation_checkpointing_enable(): the program saves each layer's input and recomputes the rest in backward;
    with a selective policy (context_fn) it also saves the outputs of the ops the policy names; the planner counts
    the smaller activation memory of each."""
    import re

    from autopar.compiler import compile_plan
    from autopar.program import RankSpec

    out, mm = {}, {}
    for ckpt in ("off", "full", "selective"):
        torch.manual_seed(0)
        model, args, _ = MODELS["llama"](batch=4, seq=16)
        if ckpt == "full":
            model.activation_checkpointing_enable()
        if ckpt == "selective":
            policy = functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])
            model.activation_checkpointing_enable({"use_reentrant": False, "context_fn": policy})
        comp = compile_plan(model, autopar.fake_mesh(SHAPE, NAMES, "cpu"), args, example_kwargs={"labels": args[0]},
                            config=Config(solver=QUIET, template_layers=None, recompute="off"))
        prog = comp.program(RankSpec.fake(NAMES, SHAPE, (0, 1)))
        out[ckpt] = (len(prog.saved), len(prog.recomputed), comp.plan.memory_breakdown["activations"])
        mm[ckpt] = [sum(bool(re.fullmatch(r"mm(_\d+)?", v)) for v in names) for names in (prog.saved, prog.recomputed)]
        assert comp.plan.recompute["model.layers"]["variant"] == {"off": "keep"}.get(ckpt, ckpt)
    assert out["full"][0] < out["off"][0] / 2 and out["full"][1] > out["off"][1], out
    assert out["full"][2] < out["off"][2] / 2, out
    # The matmuls full checkpointing recomputes (most of the 7 a layer) are saved by the policy instead.
    assert mm["full"][1] >= 10 and mm["selective"] == [mm["full"][1], 0], mm
    assert out["full"][0] < out["selective"][0] < out["off"][0] and out["selective"][1] > out["off"][1], out
    assert out["full"][2] < out["selective"][2] < out["off"][2], out


def test_a_mutated_input_is_refused():
    class Mutates(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            x.mul_(2)
            return self.fc(x).sum()

    with pytest.raises(autopar.CaptureError, match=r"changes its input .* in place.*clone"):
        autopar.plan(Mutates(), autopar.fake_mesh(2, "dp", "cpu"), (torch.randn(4, 4),),
                     config=Config(solver=QUIET))


@pytest.mark.slow
def test_frozen_weights_hold_no_gradient_or_optimizer_state_in_the_memory_model():
    plans = {}
    for freeze in (False, True):
        for m in (1, 2):
            torch.manual_seed(0)
            model, args, kwargs = MODELS["qwen2"](batch=8, seq=16)
            if freeze:
                model.model.embed_tokens.weight.requires_grad_(False)  # tied with lm_head: one tensor
            plans[freeze, m] = autopar.plan(
                model, autopar.fake_mesh(SHAPE, NAMES, "cpu"), args, example_kwargs=kwargs,
                config=Config(solver=QUIET, template_layers=None, microbatches=m,
                              input_placements={0: (Shard(0), Shard(0))},
                              # FSDP over both axes, matmuls batch-sharded (the recipe): the frozen model's plan
                              # places its activations as the other's, so their peaks compare.
                              pins={"*": (Shard(0), Shard(0)), "act:*/fwd/*mm*": (Shard(0), Shard(0))}))
    embed = 128 * 64 // 4  # elements of the embedding on each rank
    # With two microbatches the gradient buffers hold the accumulated gradients over the whole step: the frozen
    # embedding has none, nor optimizer state.
    full, frozen = plans[False, 2].memory_breakdown, plans[True, 2].memory_breakdown
    assert full["params"] == frozen["params"]
    assert full["grads"] - frozen["grads"] == embed * 4 and full["optimizer"] - frozen["optimizer"] == embed * 8
    # With one, gradients live from where the backward produces them: the frozen embedding's never is.
    full, frozen = plans[False, 1], plans[True, 1]
    assert full.memory_breakdown["optimizer"] - frozen.memory_breakdown["optimizer"] == embed * 8
    assert full.peak_memory_per_rank - frozen.peak_memory_per_rank >= embed * 8
