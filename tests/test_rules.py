"""Sharding rules: exact strategy sets for core ops, and every registered rule checked against real execution."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch import nn

from autopar.capture import capture
from autopar.codegen.kernels import FP8_CAST_ROWWISE, FP8_CAST_TENSORWISE, FP8_CAST_TRANSPOSE
from autopar.layout import P, R, S
from autopar.rules import (AxisStrategy, axis_strategies, clear_missing, einsum_strategies, fmt_strategy,
                           missing_ops, registered_targets, registry)
from autopar.rules.base import OpInfo
from autopar.testing import rule_check

aten = torch.ops.aten
F32 = torch.float32


# ---------------------------------------------------------------- models

class _Net(nn.Module):
    """Wraps a Sequential so the targets, passed as a second input, reach only the loss."""

    def __init__(self, body: nn.Module):
        super().__init__()
        self.body = body

    def forward(self, x, y=None):
        return self.body(x)


def _llama():
    from autopar.models.llama import LLAMA_TINY, Llama, cross_entropy_loss

    return Llama(LLAMA_TINY), (torch.randint(0, 256, (4, 16)),), {}, cross_entropy_loss


def _mlp():
    body = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8))
    return _Net(body), (torch.randn(8, 32), torch.randn(8, 8)), {}, lambda out, x, y: F.mse_loss(out, y)


def _mlp_ln():
    body = nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 8))
    inputs = (torch.randn(8, 32), torch.randint(0, 8, (8,)))
    return _Net(body), inputs, {}, lambda out, x, y: F.cross_entropy(out, y)


def _hf(model_cls, config, inputs, labels):
    config._attn_implementation = "sdpa"  # attention as one aten SDPA kernel, as in real training
    return model_cls(config), inputs, {"labels": labels}, None


def _hf_llama():
    tf = pytest.importorskip("transformers")

    cfg = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attention_dropout=0.0)
    ids = torch.randint(0, 128, (4, 16))
    return _hf(tf.LlamaForCausalLM, cfg, (ids,), ids)


def _gpt2():
    tf = pytest.importorskip("transformers")

    cfg = tf.GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0,
                        embd_pdrop=0, attn_pdrop=0)
    ids = torch.randint(0, 128, (4, 16))
    return _hf(tf.GPT2LMHeadModel, cfg, (ids,), ids)


def _bert():
    tf = pytest.importorskip("transformers")

    cfg = tf.BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=64, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    ids = torch.randint(0, 128, (4, 16))
    return _hf(tf.BertForMaskedLM, cfg, (ids,), ids)


def _t5():
    tf = pytest.importorskip("transformers")

    cfg = tf.T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, dropout_rate=0.0,
                      decoder_start_token_id=0, pad_token_id=0)
    ids = torch.randint(1, 128, (4, 16))
    return _hf(tf.T5ForConditionalGeneration, cfg, (ids,), ids)


def _vit():
    tf = pytest.importorskip("transformers")

    cfg = tf.ViTConfig(image_size=32, patch_size=8, num_channels=4, hidden_size=64, num_hidden_layers=2,
                       num_attention_heads=4, intermediate_size=128, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0, num_labels=10)
    return _hf(tf.ViTForImageClassification, cfg, (torch.randn(4, 4, 32, 32),), torch.randint(0, 10, (4,)))


MODELS = {"llama": _llama, "mlp": _mlp, "mlp_layernorm_ce": _mlp_ln, "hf_llama": _hf_llama, "gpt2": _gpt2,
          "bert": _bert, "t5": _t5, "vit": _vit}


@functools.lru_cache(maxsize=None)
def traced(name: str):
    """(captured graph, concrete (args, kwargs) of every call) for one model, once per session."""
    torch.manual_seed(0)
    model, args, kwargs, loss_fn = MODELS[name]()
    cap = capture(model, args, kwargs, loss_fn=loss_fn)
    calls = rule_check.record_calls(cap.gm, rule_check.placeholder_values(cap, model, args, kwargs))
    return cap, calls


def _ops(name: str) -> set:
    return rule_check.graph_ops(traced(name)[0])


@pytest.mark.parametrize("name", list(MODELS))
def test_every_op_of_model_has_a_rule(name):
    unknown = rule_check.ops_without_rules(traced(name)[0])
    assert not unknown, f"{name}: no rule for {unknown}"


@pytest.mark.parametrize("name", list(MODELS))
def test_rules_match_execution(name):
    cap, calls = traced(name)
    errors = rule_check.check_graph(cap.gm, calls, 2) + rule_check.check_graph(cap.gm, calls, 4)
    assert not errors, "\n".join(errors[:30])


# ---------------------------------------------------------------- exact strategy sets

def _info(target, args, kwargs=None):
    """OpInfo of a call on real tensors (what op_info gives for a traced node)."""
    kwargs = kwargs or {}
    out = target(*args, **kwargs)
    return rule_check.info_of(target, args, kwargs, list(out) if isinstance(out, (tuple, list)) else [out])


def _fmt(strategies):
    return [fmt_strategy(s) for s in strategies]


def test_mm_strategies_are_exactly_the_einsum_ones():
    got, known = axis_strategies(_info(aten.mm.default, (torch.randn(4, 8), torch.randn(8, 6))))
    assert known
    assert _fmt(got) == ["R,R -> R", "S(0),R -> S(0)", "R,S(1) -> S(1)", "S(1),S(0) -> P"]
    assert _fmt(einsum_strategies("mk,kn->mn")) == _fmt(got[1:])


def test_einsum_linearity_and_batch_index():
    assert _fmt(einsum_strategies("bmk,bkn->bmn")) == [
        "S(0),S(0) -> S(0)", "S(1),R -> S(1)", "R,S(2) -> S(2)", "S(2),S(1) -> P"]
    lin = _fmt(einsum_strategies("mk,kn->mn", linearity=True))
    assert lin[3:] == ["P,R -> P", "P(avg),R -> P(avg)", "R,P -> P", "R,P(avg) -> P(avg)"]


def test_add_with_broadcasting():
    got, _ = axis_strategies(_info(aten.add.Tensor, (torch.randn(4, 1, 6), torch.randn(5, 6))))
    assert _fmt(got) == ["R,R -> R", "S(0),R -> S(0)", "R,S(0) -> S(1)", "S(2),S(1) -> S(2)", "P,P -> P",
                         "P(avg),P(avg) -> P(avg)"]
    # Adding a python scalar is affine, not linear: no Partial.
    got, _ = axis_strategies(_info(aten.add.Tensor, (torch.randn(4, 6), 1.0)))
    assert _fmt(got) == ["R -> R", "S(0) -> S(0)", "S(1) -> S(1)"]


def test_mul_partial_rules():
    got, _ = axis_strategies(_info(aten.mul.Tensor, (torch.randn(4, 6), torch.randn(6))))
    assert {"P,R -> P", "R,P -> P"} <= set(_fmt(got)) and "P,P -> P" not in _fmt(got)


def test_view_flatten_and_split():
    got, _ = axis_strategies(_info(aten.view.default, (torch.randn(2, 8, 6), [16, 6])))
    assert _fmt(got) == ["R -> R", "S(0) -> S(0)", "S(2) -> S(1)", "P -> P", "P(avg) -> P(avg)"]
    got, _ = axis_strategies(_info(aten.view.default, (torch.randn(16, 6), [2, 8, 3, 2])))
    assert _fmt(got)[1:3] == ["S(0) -> S(0)", "S(1) -> S(2)"]


def test_sum_with_keepdim():
    got, _ = axis_strategies(_info(aten.sum.dim_IntList, (torch.randn(4, 6, 8), [1], True)))
    assert _fmt(got) == ["R -> R", "S(0) -> S(0)", "S(1) -> P", "S(2) -> S(2)", "P -> P", "P(avg) -> P(avg)"]
    got, _ = axis_strategies(_info(aten.mean.dim, (torch.randn(4, 6, 8), [-1])))
    assert _fmt(got)[1:4] == ["S(0) -> S(0)", "S(1) -> S(1)", "S(2) -> P(avg)"]


def test_softmax_keeps_its_dim_whole():
    got, _ = axis_strategies(_info(aten._log_softmax.default, (torch.randn(4, 6), 1, False)))
    assert _fmt(got) == ["R -> R", "S(0) -> S(0)"]


def test_attention_shards_batch_and_heads_only():
    q, kv = torch.randn(2, 4, 8, 16), torch.randn(2, 2, 8, 16)
    mask = torch.zeros(1, 1, 8, 8)
    got, _ = axis_strategies(_info(aten._scaled_dot_product_flash_attention_for_cpu.default, (q, kv, kv),
                                   {"attn_mask": mask}))
    assert _fmt(got) == ["R,R,R,R -> R,R", "S(0),S(0),S(0),R -> S(0),S(0)", "S(1),S(1),S(1),R -> S(1),S(1)"]


GPU_ATTENTION = {
    aten._scaled_dot_product_flash_attention.default: lambda q, m: (q, q, q, 0.0, True),
    aten._scaled_dot_product_efficient_attention.default: lambda q, m: (q, q, q, m, True, 0.0, False),
    aten._scaled_dot_product_cudnn_attention.default: lambda q, m: (q, q, q, m, True, 0.0, False, False),
}


@pytest.mark.parametrize("target", list(GPU_ATTENTION), ids=str)
def test_gpu_attention_rules_on_meta_shapes(target):
    """GPU kernels cannot run here; check their layouts from meta shapes: q/k/v/mask and every (B, H, ...)
    output follow the sharded dim, auxiliary outputs (rng state, seeds) replicate; backward likewise."""
    q, mask = torch.empty(2, 4, 16, 8, device="meta"), torch.empty(2, 1, 16, 16, device="meta")
    args = GPU_ATTENTION[target](q, mask)
    out = target(*args)
    info = rule_check.info_of(target, args, {}, list(out))
    got, known = axis_strategies(info)
    assert known and len(got) == 3
    _assert_follows(info, got)
    bw = {aten._scaled_dot_product_efficient_attention.default:
          lambda: (aten._scaled_dot_product_efficient_attention_backward.default,
                   (q, q, q, q, mask, out[0], out[1], out[2], out[3], 0.0, [True, True, True, True], False)),
          aten._scaled_dot_product_flash_attention.default:
          lambda: (aten._scaled_dot_product_flash_attention_backward.default,
                   (q, q, q, q, out[0], out[1], None, None, 16, 16, 0.0, True, out[6], out[7]))}
    if target in bw:
        bw_target, bw_args = bw[target]()
        bw_info = rule_check.info_of(bw_target, bw_args, {}, list(bw_target(*bw_args)))
        got = axis_strategies(bw_info)[0]
        _assert_follows(bw_info, got)
        if bw_target is aten._scaled_dot_product_efficient_attention_backward.default:
            assert got[2].outs[3] == P  # the mask's gradient, summed over the heads it was broadcast over


def _assert_follows(info: OpInfo, strategies: list[AxisStrategy]):
    for s, dim in zip(strategies[1:], (0, 1)):
        for p, m in zip(s.ins + s.outs, info.inputs + info.outputs):
            if m is None or m.ndim < 3:
                assert p == R, (fmt_strategy(s), m)
            elif m.shape[dim] > 1:
                assert p == S(dim), (fmt_strategy(s), m)


# ---------------------------------------------------------------- the checker catches wrong rules

def test_a_wrong_rule_fails_naming_op_and_strategy(monkeypatch):
    wrong = lambda info: [AxisStrategy((S(1), S(0)), (S(0),)), AxisStrategy((R, S(0)), (S(1),))]  # noqa: E731
    monkeypatch.setitem(registry._RULES, aten.mm.default, wrong)
    cap, calls = traced("mlp")
    node = next(n for n in cap.gm.graph.nodes if n.target is aten.mm.default)
    errors = rule_check.check_node(node, calls[node], 2)
    assert len(errors) == 2
    assert all("aten.mm.default" in e for e in errors)
    assert "[S(1),S(0) -> S(0)]" in errors[0] and "[R,S(0) -> S(1)]" in errors[1]


def test_a_rule_with_wrong_arity_is_reported(monkeypatch):
    monkeypatch.setitem(registry._RULES, aten.mm.default, lambda info: [AxisStrategy((S(0),), (S(0),))])
    with pytest.raises(RuntimeError, match="aten.mm.default"):
        axis_strategies(_info(aten.mm.default, (torch.randn(4, 8), torch.randn(8, 6))))


# ---------------------------------------------------------------- ops outside the model graphs

def _t(*shape, dtype=F32, positive=False):
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if not dtype.is_floating_point:
        return torch.randint(0, 4, shape, dtype=dtype)
    x = torch.randn(shape, dtype=dtype)
    return x.abs() + 0.5 if positive else x


UNARY = [aten.abs.default, aten.ceil.default, aten.floor.default, aten.round.default, aten.trunc.default,
         aten.cos.default, aten.sin.default, aten.erf.default, aten.exp.default, aten.expm1.default,
         aten.log.default, aten.log1p.default, aten.log2.default, aten.gelu.default, aten.relu.default,
         aten.rsqrt.default, aten.sqrt.default, aten.sigmoid.default, aten.sign.default, aten.silu.default,
         aten.softplus.default, aten.tanh.default, aten.reciprocal.default, aten.isinf.default, aten.isnan.default,
         aten.elu.default, aten.hardtanh.default, aten.leaky_relu.default, aten.neg.default]
BINARY = [aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.atan2.default,
          aten.maximum.default, aten.minimum.default, aten.pow.Tensor_Tensor, aten.remainder.Tensor,
          aten.fmod.Tensor, aten.eq.Tensor, aten.ne.Tensor, aten.lt.Tensor, aten.le.Tensor, aten.gt.Tensor,
          aten.ge.Tensor, aten.rsub.Tensor]
LOGICAL = [aten.logical_and.default, aten.logical_or.default, aten.logical_xor.default,
           aten.bitwise_and.Tensor, aten.bitwise_or.Tensor, aten.bitwise_xor.Tensor]

_MASK = torch.randn(4, 1, 8, 8)
CASES = (
    [(op, lambda: (_t(4, 6, positive=True),), {}) for op in UNARY]
    + [(op, lambda: (_t(4, 6, positive=True), _t(6, positive=True)), {}) for op in BINARY]
    + [(op, lambda: (_t(4, 6, dtype=torch.bool), _t(1, 6, dtype=torch.bool)), {}) for op in LOGICAL]
    + [
        (aten.logical_not.default, lambda: (_t(4, 6, dtype=torch.bool),), {}),
        (aten.bitwise_not.default, lambda: (_t(4, 6, dtype=torch.bool),), {}),
        (aten.mul.Tensor, lambda: (_t(4, 6), 3.0), {}),
        (aten.div.Tensor, lambda: (_t(4, 6), _t(4, 1, positive=True)), {}),
        (aten.clamp.default, lambda: (_t(4, 6), -0.5, 0.5), {}),
        (aten.clamp_min.default, lambda: (_t(4, 6), 0.1), {}),
        (aten.clamp_max.default, lambda: (_t(4, 6), 0.1), {}),
        (aten.pow.Tensor_Scalar, lambda: (_t(4, 6), 3), {}),
        (aten.masked_fill.Scalar, lambda: (_t(4, 6), _t(4, 6, dtype=torch.bool), 0.0), {}),
        (aten.where.ScalarOther, lambda: (_t(4, 6, dtype=torch.bool), _t(4, 6), 0.0), {}),
        (aten.where.ScalarSelf, lambda: (_t(4, 6, dtype=torch.bool), 1.0, _t(6)), {}),
        (aten.where.self, lambda: (_t(4, 1, dtype=torch.bool), _t(4, 6), _t(6)), {}),
        (aten.sigmoid_backward.default, lambda: (_t(4, 6), _t(4, 6)), {}),
        (aten.hardtanh_backward.default, lambda: (_t(4, 6), _t(4, 6), -0.5, 0.5), {}),
        (aten.leaky_relu_backward.default, lambda: (_t(4, 6), _t(4, 6), 0.01, False), {}),
        (aten.native_dropout.default, lambda: (_t(4, 6), 0.0, True), {}),  # p > 0: tests/test_dropout.py
        (aten.native_dropout_backward.default, lambda: (_t(4, 6), _t(4, 6, dtype=torch.bool), 2.0), {}),
        (aten._to_copy.default, lambda: (_t(4, 6, dtype=torch.int64),), {"dtype": F32}),
        (aten.copy.default, lambda: (_t(4, 6), _t(6)), {}),
        (aten.mv.default, lambda: (_t(4, 6), _t(6)), {}),
        (aten.dot.default, lambda: (_t(6), _t(6)), {}),
        (aten.baddbmm.default, lambda: (_t(4, 1, 6), _t(4, 2, 8), _t(4, 8, 6)), {}),
        (aten.addmv.default, lambda: (_t(4), _t(4, 6), _t(6)), {}),
        (aten.reshape.default, lambda: (_t(4, 6, 2), [4, 12]), {}),
        (aten.squeeze.default, lambda: (_t(4, 1, 6),), {}),
        (aten.squeeze.dims, lambda: (_t(4, 1, 6, 1), [1, 3]), {}),
        (aten.permute.default, lambda: (_t(4, 2, 6), [2, 0, 1]), {}),
        (aten.unbind.int, lambda: (_t(4, 2, 6), 1), {}),
        (aten.contiguous.default, lambda: (_t(4, 6).t(),), {}),
        (aten.split_with_sizes.default, lambda: (_t(4, 6), [2, 4], 1), {}),
        (aten.stack.default, lambda: ([_t(4, 6), _t(4, 6)], 1), {}),
        (aten.scatter.src, lambda: (_t(4, 6), 1, torch.randint(0, 6, (4, 2)), _t(4, 2)), {}),
        (aten.scatter_add.default, lambda: (_t(4, 6), 1, torch.randint(0, 6, (4, 6)), _t(4, 6)), {}),
        (aten.index_select.default, lambda: (_t(4, 6), 1, torch.tensor([0, 2, 5, 1])), {}),
        # x[rows, cols] with broadcast index tensors (a padded batch's mask gather), adjacent and not, and with a
        # dim taken whole in between (the advanced dims then go in front)
        (aten.index.Tensor, lambda: (_t(4, 8), [torch.arange(4).view(4, 1, 1, 1), torch.arange(8).view(1, 1, 1, 8)]),
         {}),
        (aten.index.Tensor, lambda: (_t(4, 6, 8), [None, torch.tensor([[0, 5], [2, 3]])]), {}),
        (aten.index.Tensor, lambda: (_t(4, 6, 8), [torch.tensor([1, 3]), None, torch.tensor([0, 7])]), {}),
        (aten.slice_scatter.default, lambda: (_t(4, 6), _t(4, 2), 1, 2, 4), {}),
        (aten.select_scatter.default, lambda: (_t(4, 6), _t(4), 1, 3), {}),
        (aten.constant_pad_nd.default, lambda: (_t(4, 6), [1, 2]), {}),
        (aten.mean.default, lambda: (_t(4, 6),), {}),
        (aten.amax.default, lambda: (_t(4, 6, 2), [1]), {}),
        (aten.amin.default, lambda: (_t(4, 6, 2), [1], True), {}),
        (aten.max.dim, lambda: (_t(4, 6), 1), {}),
        (aten.min.dim, lambda: (_t(4, 6), 0, True), {}),
        (aten.any.dim, lambda: (_t(4, 6, dtype=torch.bool), 1), {}),
        (aten.all.dim, lambda: (_t(4, 6, dtype=torch.bool), 0), {}),
        (aten.any.dims, lambda: (_t(4, 6, 2, dtype=torch.bool), [0, 2]), {}),
        (aten.all.dims, lambda: (_t(4, 6, 2, dtype=torch.bool), [1]), {}),
        (aten.logsumexp.default, lambda: (_t(4, 6), [1]), {}),
        (aten.argmax.default, lambda: (_t(4, 6), 1), {}),
        (aten.argmin.default, lambda: (_t(4, 6), 0, True), {}),
        (aten._softmax.default, lambda: (_t(4, 6), 1, False), {}),
        (aten.cumsum.default, lambda: (_t(4, 6), 1), {}),
        (aten.mse_loss.default, lambda: (_t(4, 6), _t(4, 6), 2), {}),
        (aten.mse_loss.default, lambda: (_t(4, 6), _t(4, 6), 0), {}),
        (aten.mse_loss_backward.default, lambda: (_t(), _t(4, 6), _t(4, 6), 2), {}),
        (aten.mse_loss_backward.default, lambda: (_t(4, 6), _t(4, 6), _t(4, 6), 0), {}),
        (aten._fused_rms_norm.default, lambda: (_t(4, 2, 6), [6], _t(6), 1e-5), {}),
        (aten.native_layer_norm.default, lambda: (_t(4, 2, 6), [2, 6], _t(2, 6), None, 1e-5), {}),
        (aten.convolution.default, lambda: (_t(4, 4, 6, 6), _t(6, 4, 3, 3), _t(6), [1, 1], [1, 1], [1, 1], False,
                                            [0, 0], 1), {}),
        (aten.convolution_backward.default, lambda: (_t(4, 6, 6, 6), _t(4, 4, 6, 6), _t(6, 4, 3, 3), [6], [1, 1],
                                                     [1, 1], [1, 1], False, [0, 0], 1, [True, True, True]), {}),
        (aten.ones_like.default, lambda: (_t(4, 6),), {}),
        (aten.fill.Scalar, lambda: (_t(4, 6), 2.0), {}),
        (aten.fill.Tensor, lambda: (_t(4, 6), _t()), {}),
        (aten.new_ones.default, lambda: (_t(4, 6), [4, 2]), {}),
        (aten.new_full.default, lambda: (_t(4, 6), [4, 6], 3.0), {}),
        (aten._scaled_dot_product_attention_math.default, lambda: (_t(4, 4, 8, 6), _t(4, 4, 8, 6), _t(4, 4, 8, 6),
                                                                   _t(4, 1, 8, 8)), {}),
        (aten._scaled_dot_product_flash_attention_for_cpu.default,
         lambda: (_t(4, 4, 8, 6), _t(4, 2, 8, 6), _t(4, 2, 8, 6)), {"attn_mask": _t(1, 4, 8, 8)}),
        (aten._scaled_dot_product_flash_attention_for_cpu_backward.default, lambda: _sdpa_backward_args(),
         {"attn_mask": _MASK}),
        # autopar's FP8 casts (autopar/rules/fp8.py): outputs compared bit for bit
        (FP8_CAST_ROWWISE, lambda: (_t(4, 6) * 100, "e4m3"), {}),
        (FP8_CAST_TRANSPOSE, lambda: (_t(4, 6) * 100, "e5m2", True), {}),
        (FP8_CAST_TRANSPOSE, lambda: (_t(4, 6) * 100, "e4m3", False, _t(positive=True) * 100), {}),
        (FP8_CAST_TENSORWISE, lambda: (_t(4, 6) * 100, "e4m3", _t(positive=True) * 100), {}),
    ]
)


def _sdpa_backward_args():
    q, kv = _t(4, 4, 8, 6), _t(4, 2, 8, 6)
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu.default(q, kv, kv, attn_mask=_MASK)
    return _t(4, 4, 8, 6), q, kv, kv, out, lse, 0.0, False


@pytest.mark.parametrize("case", range(len(CASES)), ids=[str(c[0]) for c in CASES])
def test_rule_matches_execution_outside_models(case):
    target, make_args, kwargs = CASES[case]
    torch.manual_seed(case)
    args = make_args()
    info = _info(target, args, kwargs)
    strategies, known = axis_strategies(info)
    assert known and len(strategies) > 1, (str(target), _fmt(strategies))
    errors = rule_check.check_call(target, args, kwargs, 2) + rule_check.check_call(target, args, kwargs, 4)
    assert not errors, "\n".join(errors)


def test_every_registered_rule_is_exercised():
    """Each registered op appears in a model graph or an op case here or in test_rules_vision.py, or is exempt for a
    stated reason."""
    import test_rules_vision as vision

    covered = set().union(*(_ops(name) for name in MODELS), *(vision.ops(name) for name in vision.MODELS))
    covered |= {c[0] for c in CASES + vision.CASES}
    covered |= {t.overloadpacket for t in covered}
    exempt = {aten.scalar_tensor, aten.full, aten.zeros, aten.ones, aten.empty, aten.empty_strided,
              aten.arange}  # no tensor input: all-replicate only
    exempt |= {aten.empty_like.default, aten.new_empty.default}  # undefined values
    exempt |= {aten._fused_rms_norm_backward.default}  # no CPU kernel
    exempt |= set(GPU_ATTENTION) | {aten._scaled_dot_product_fused_attention_overrideable.default,
                                    aten._scaled_dot_product_fused_attention_overrideable_backward.default,
                                    aten._scaled_dot_product_cudnn_attention_backward.default,
                                    aten._scaled_dot_product_flash_attention_backward.default,
                                    aten._scaled_dot_product_efficient_attention_backward.default}  # GPU kernels
    left = [str(t) for t in registered_targets() if t not in covered and t not in exempt]
    assert not left, f"registered rules never checked by execution: {left}"


# ---------------------------------------------------------------- reshape grouping, property-based

@st.composite
def _reshapes(draw):
    dims = draw(st.lists(st.sampled_from([1, 2, 3, 4, 6]), min_size=1, max_size=4))
    # Regroup the prime-ish factors of the same sizes into a new shape of equal numel.
    factors = [f for d in dims for f in _factor(d)]
    cuts = sorted(draw(st.sets(st.integers(1, max(len(factors) - 1, 1)), max_size=3)))
    new, prev = [], 0
    for c in cuts + [len(factors)]:
        if c > prev:
            new.append(int(torch.tensor(factors[prev:c]).prod()))
            prev = c
    return dims, new or [1]


def _factor(n: int) -> list[int]:
    out, p = [], 2
    while n > 1:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return out or [1]


@settings(max_examples=25, deadline=None)
@given(_reshapes())
def test_view_rule_matches_execution_for_any_reshape(shapes):
    src, dst = shapes
    x = torch.randn(src)
    errors = rule_check.check_call(aten.view.default, (x, dst), {}, 2)
    assert not errors, "\n".join(errors)


# ---------------------------------------------------------------- DTensor fallback

def test_ops_without_rules_fall_back_to_dtensor_and_are_reported():
    clear_missing()
    x = torch.randn(4, 6)
    strategies, known = axis_strategies(_info(aten.sort.default, (x, 1)))
    assert not known and "aten.sort.default" in missing_ops()
    assert "S(0) -> S(0),S(0)" in _fmt(strategies)
    assert not torch.distributed.is_initialized()
    for target, args in [(aten.sort.default, (x, 1)), (aten.topk.default, (x, 2, 1)),
                         (aten.var.correction, (x, [1])), (aten.hypot.default, (x, x.flip(0)))]:
        assert not axis_strategies(_info(target, args))[1]
        errors = rule_check.check_call(target, args, {}, 2)
        assert not errors, "\n".join(errors)
    clear_missing()


def test_partial_on_bool_or_integer_average_is_dropped():
    got, _ = axis_strategies(_info(aten.sum.default, (torch.rand(8) > 0.5,)))
    assert _fmt(got) == ["R -> R", "S(0) -> P"]

