"""Sharding rules of convolutional and audio layers (convolution, batch/group/weight norm, pooling, upsampling,
advanced indexing) checked against execution, and the layouts they must never offer."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autopar.capture import capture
from autopar.layout import P_AVG, R, S
from autopar.rules import AxisStrategy, axis_strategies, fmt_strategy
from autopar.testing import rule_check

aten = torch.ops.aten


# ---------------------------------------------------------------- models

class Classifier(nn.Module):
    """A convolutional body, flattened into a linear head; cross-entropy with the labels inside forward."""

    def __init__(self, body: nn.Module, features: int, classes: int = 10):
        super().__init__()
        self.body = body
        self.head = nn.Linear(features, classes)

    def forward(self, x, labels):
        return F.cross_entropy(self.head(self.body(x).flatten(1)), labels)


def small_cnn(width: int = 8) -> Classifier:
    """Conv2d + BatchNorm2d + ReLU blocks (strided, dilated, depthwise), max, average and adaptive pooling."""
    body = nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(3, 2, 1),
        nn.Conv2d(width, width, 3, stride=2, padding=2, dilation=2, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
        nn.Conv2d(width, width, 3, padding=1, groups=width), nn.AdaptiveAvgPool2d(3), nn.AvgPool2d(2, stride=1))
    return Classifier(body, width * 2 * 2)


class _Sum(nn.Module):
    def __init__(self, *mods: nn.Module):
        super().__init__()
        self.mods = nn.ModuleList(mods)

    def forward(self, x):
        return sum(m(x) for m in self.mods)


def _images(shape, classes: int = 10):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(shape, generator=g), torch.randint(0, classes, (shape[0],), generator=g))


def _cnn(train: bool = True):
    model = small_cnn().train(train)
    return model, _images((8, 3, 16, 16))


def _conv1d():
    body = nn.Sequential(
        nn.Conv1d(4, 8, 5, stride=2, padding=2, groups=2), nn.GroupNorm(4, 8), nn.GELU(),
        nn.utils.parametrizations.weight_norm(nn.Conv1d(8, 8, 4, padding=2, groups=8), dim=2),
        nn.BatchNorm1d(8), nn.MaxPool1d(2), nn.Upsample(scale_factor=2), nn.AvgPool1d(3, stride=1, padding=1),
        nn.ConvTranspose1d(8, 4, 4, stride=2, padding=1), nn.Upsample(scale_factor=2, mode="linear"),
        nn.AdaptiveMaxPool1d(4))
    return Classifier(body, 16), _images((8, 4, 32))


def _conv3d():
    body = nn.Sequential(
        nn.Conv3d(2, 4, 3, padding=1), nn.BatchNorm3d(4, track_running_stats=False), nn.ReLU(), nn.MaxPool3d(2),
        nn.Upsample(scale_factor=2, mode="trilinear"), nn.AvgPool3d(2),
        _Sum(nn.AdaptiveMaxPool3d(2), nn.AdaptiveAvgPool3d(2)))
    return Classifier(body, 32), _images((4, 2, 8, 8, 8))


def _unet():
    body = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.SiLU(), nn.Conv2d(8, 8, 3, stride=2, padding=1),
        nn.Upsample(scale_factor=2, mode="bilinear"), nn.ConvTranspose2d(8, 4, 2, stride=2),
        nn.BatchNorm2d(4, affine=False), nn.AdaptiveMaxPool2d(2))
    return Classifier(body, 16), _images((8, 3, 8, 8))


def _hf(name: str, **sizes):
    def build():
        pytest.importorskip("transformers")
        from autopar.testing.hf_models import MODELS as HF

        model, args, kwargs = HF[name](batch=4, **sizes)
        return model, args, kwargs
    return build


MODELS = {"cnn": _cnn, "cnn_eval": lambda: _cnn(train=False), "conv1d": _conv1d, "conv3d": _conv3d,
          "unet": _unet, "hf_resnet": _hf("resnet"), "hf_wav2vec2": _hf("wav2vec2", seq=8),
          "hf_whisper": _hf("whisper", seq=8)}


@functools.lru_cache(maxsize=None)
def traced(name: str):
    torch.manual_seed(0)
    model, args, *kwargs = MODELS[name]()
    kwargs = kwargs[0] if kwargs else {}
    cap = capture(model, args, kwargs)
    calls = rule_check.record_calls(cap.gm, rule_check.placeholder_values(cap, model, args, kwargs))
    return cap, calls


def ops(name: str) -> set:
    return rule_check.graph_ops(traced(name)[0])


@pytest.mark.parametrize("name", list(MODELS))
def test_every_op_of_model_has_a_rule(name):
    unknown = rule_check.ops_without_rules(traced(name)[0])
    assert not unknown, f"{name}: no rule for {unknown}"


def test_models_hold_the_ops_they_are_here_for():
    assert {aten._native_batch_norm_legit_functional.default, aten.native_batch_norm_backward.default,
            aten.max_pool2d_with_indices_backward.default, aten.avg_pool2d_backward.default,
            aten._adaptive_avg_pool2d_backward.default} <= ops("cnn")
    assert aten._native_batch_norm_legit_no_training.default in ops("cnn_eval")
    assert {aten.native_group_norm_backward.default, aten._weight_norm_interface_backward.default,
            aten._unsafe_index.Tensor, aten._unsafe_index_put.default} <= ops("conv1d")
    assert {aten._native_batch_norm_legit.no_stats, aten.max_pool3d_with_indices_backward.default,
            aten.adaptive_max_pool3d_backward.default, aten._adaptive_avg_pool3d_backward.default} <= ops("conv3d")
    assert aten.adaptive_max_pool2d_backward.default in ops("unet")


@pytest.mark.parametrize("name", list(MODELS))
def test_rules_match_execution(name):
    cap, calls = traced(name)
    errors = rule_check.check_graph(cap.gm, calls, 2) + rule_check.check_graph(cap.gm, calls, 4)
    assert not errors, "\n".join(errors[:30])


# ---------------------------------------------------------------- ops outside the model graphs

def _t(*shape, dtype=torch.float32):
    return torch.randn(shape, dtype=dtype)


def _upsample(op, size, *extra):
    return op, lambda: (_t(4, 4, *[3] * len(size)), size, *extra), {}


def _upsample_backward(op, size, *extra):
    return op, lambda: (_t(4, 4, *size), size, [4, 4] + [3] * len(size), *extra), {}


CASES = [
    _upsample(aten.upsample_nearest1d.default, [5]),
    _upsample(aten.upsample_nearest2d.default, [5, 6]),
    _upsample(aten.upsample_nearest3d.default, [5, 4, 6]),
    _upsample(aten.upsample_linear1d.default, [5], False),
    _upsample(aten.upsample_bilinear2d.default, [5, 6], True),
    _upsample(aten.upsample_bicubic2d.default, [5, 6], False),
    _upsample(aten.upsample_trilinear3d.default, [5, 4, 6], False),
    _upsample_backward(aten.upsample_nearest1d_backward.default, [5]),
    _upsample_backward(aten.upsample_nearest2d_backward.default, [5, 6]),
    _upsample_backward(aten.upsample_nearest3d_backward.default, [5, 4, 6]),
    _upsample_backward(aten.upsample_linear1d_backward.default, [5], False),
    _upsample_backward(aten.upsample_bilinear2d_backward.default, [5, 6], True),
    _upsample_backward(aten.upsample_bicubic2d_backward.default, [5, 6], False),
    _upsample_backward(aten.upsample_trilinear3d_backward.default, [5, 4, 6], False),
    # A depthwise convolution with a channel multiplier (groups == C_in) and one that merges channels
    # (groups == C_out), forward and backward, transposed too.
    (aten.convolution.default, lambda: (_t(4, 4, 6), _t(8, 1, 3), _t(8), [1], [1], [1], False, [0], 4), {}),
    (aten.convolution.default, lambda: (_t(4, 8, 6), _t(4, 2, 3), None, [2], [0], [1], False, [0], 4), {}),
    (aten.convolution.default, lambda: (_t(4, 4, 6, 6), _t(4, 2, 3, 3), _t(8), [2, 2], [1, 1], [1, 1], True,
                                        [1, 1], 4), {}),
    (aten.convolution_backward.default, lambda: (_t(4, 8, 6), _t(4, 4, 6), _t(8, 1, 3), [8], [1], [1], [1], False,
                                                 [0], 4, [True, True, True]), {}),
    (aten.convolution_backward.default, lambda: (_t(4, 8, 11, 11), _t(4, 4, 6, 6), _t(4, 2, 3, 3), [8], [2, 2],
                                                 [1, 1], [1, 1], True, [0, 0], 4, [True, True, False]), {}),
    (aten.repeat.default, lambda: (_t(1, 4), [4, 1]), {}),
    (aten.repeat.default, lambda: (_t(4, 1, 2), [2, 1, 4, 3]), {}),
    # An embedding-like lookup (Whisper's decoder positions) and its accumulating backward; a lookup with
    # non-adjacent index tensors moves the index block to the front.
    (aten.index.Tensor, lambda: (_t(8, 4), [torch.randint(0, 8, (4, 6))]), {}),
    (aten.index.Tensor, lambda: (_t(4, 6, 8), [torch.randint(0, 4, (2, 4)), None, torch.randint(0, 8, (4,))]), {}),
    (aten.index_put.default, lambda: (_t(8, 4), [torch.randint(0, 8, (4, 6))], _t(4, 6, 4), True), {}),
    (aten.index_put.default, lambda: (_t(4, 8, 6), [None, torch.arange(8).flip(0)[:4]], _t(4, 4, 6)), {}),
]


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


# ---------------------------------------------------------------- what must never be offered

def _info(target, args, kwargs=None):
    kwargs = kwargs or {}
    out = target(*args, **kwargs)
    return rule_check.info_of(target, args, kwargs, list(out) if isinstance(out, (tuple, list)) else [out])


def _fmt(strategies):
    return [fmt_strategy(s) for s in strategies]


def _bn_args(train: bool):
    x, vec = _t(8, 4, 3, 3), lambda: _t(4)
    if train:
        return aten._native_batch_norm_legit_functional.default, (x, vec(), vec(), vec(), vec().abs(), True, 0.1, 1e-5)
    return aten._native_batch_norm_legit_no_training.default, (x, vec(), vec(), vec(), vec().abs(), 0.1, 1e-5)


def test_training_batch_norm_shards_channels_only():
    """The statistics span the batch and every position: sharding them would make each rank normalize with its
    own statistics, which the one-device model never does."""
    target, args = _bn_args(train=True)
    got, _ = axis_strategies(_info(target, args))
    assert _fmt(got) == ["R,R,R,R,R -> R,R,R,R,R", "S(1),S(0),S(0),S(0),S(0) -> S(1),S(0),S(0),S(0),S(0)"]
    out, mean, rstd = target(*args)[:3]
    grad_args = (_t(8, 4, 3, 3), args[0], args[1], args[3], args[4], mean, rstd, True, 1e-5, [True] * 3)
    got, _ = axis_strategies(_info(aten.native_batch_norm_backward.default, grad_args))
    assert _fmt(got) == ["R,R,R,R,R,R,R -> R,R,R", "S(1),S(1),S(0),S(0),S(0),S(0),S(0) -> S(1),S(0),S(0)",
                         "P,R,R,R,R,R,R -> P,P,P", "P(avg),R,R,R,R,R,R -> P(avg),P(avg),P(avg)"]
    assert not rule_check.check_call(aten.native_batch_norm_backward.default, grad_args, {}, 4)


def test_local_batch_statistics_fail_the_check(monkeypatch):
    """Negative control: a rule claiming batch-sharded training batch norm is right is caught by execution; in
    eval mode (running statistics) the same layout is exact and offered."""
    target, args = _bn_args(train=True)
    wrong = AxisStrategy((S(0), R, R, R, R), (S(0), P_AVG, R, P_AVG, R))
    errors = rule_check.check_call(target, args, {}, 2, strategies=[wrong])
    assert len(errors) == 1 and "output 0" in errors[0]
    target, args = _bn_args(train=False)
    got, _ = axis_strategies(_info(target, args))
    assert "S(0),R,R,R,R -> S(0),R,R" in _fmt(got)
    assert not rule_check.check_call(target, args, {}, 4)


def test_pooling_keeps_spatial_dims_whole():
    args = (_t(4, 4, 8, 8), [3, 3], [2, 2], [1, 1], [1, 1], False)
    got, _ = axis_strategies(_info(aten.max_pool2d_with_indices.default, args))
    assert _fmt(got) == ["R -> R,R", "S(0) -> S(0),S(0)", "S(1) -> S(1),S(1)"]
    # Negative control: a window crossing the shard boundary reads rows the rank does not hold.
    spatial = AxisStrategy((S(2),), (S(2), S(2)))
    assert rule_check.check_call(aten.max_pool2d_with_indices.default, args, {}, 2, strategies=[spatial])


def test_convolution_strategies():
    x, w, b = _t(4, 8, 6, 6), _t(6, 8, 3, 3), _t(6)
    conv = lambda x, w, b, transposed=False, groups=1: _fmt(axis_strategies(_info(  # noqa: E731
        aten.convolution.default, (x, w, b, [1, 1], [1, 1], [1, 1], transposed, [0, 0], groups)))[0])
    assert conv(x, w, b) == ["R,R,R -> R", "S(0),R,R -> S(0)", "R,S(0),S(0) -> S(1)", "S(1),S(1),P -> P"]
    assert conv(x, _t(8, 6, 3, 3), b, transposed=True) == [
        "R,R,R -> R", "S(0),R,R -> S(0)", "R,S(1),S(0) -> S(1)", "S(1),S(0),P -> P"]
    assert conv(x, _t(8, 1, 3, 3), _t(8), groups=8) == ["R,R,R -> R", "S(0),R,R -> S(0)", "S(1),S(0),S(0) -> S(1)"]
    # Two groups of four channels: an even split of the channels over 4 ranks would cut the groups.
    grouped = (x, _t(8, 4, 3, 3), _t(8), [1, 1], [1, 1], [1, 1], False, [0, 0], 2)
    assert _fmt(axis_strategies(_info(aten.convolution.default, grouped))[0]) == ["R,R,R -> R", "S(0),R,R -> S(0)"]
    by_channel = AxisStrategy((S(1), S(0), S(0)), (S(1),))
    assert not rule_check.check_call(aten.convolution.default, grouped, {}, 2, strategies=[by_channel])
    assert rule_check.check_call(aten.convolution.default, grouped, {}, 4, strategies=[by_channel])


def test_group_norm_shards_batch_and_whole_groups():
    args = (_t(4, 8, 5), _t(8), _t(8), 4, 8, 5, 2, 1e-5)
    got, _ = axis_strategies(_info(aten.native_group_norm.default, args))
    assert _fmt(got) == ["R,R,R -> R,R,R", "S(0),R,R -> S(0),S(0),S(0)", "S(1),S(0),S(0) -> S(1),S(1),S(1)"]
    assert not rule_check.check_call(aten.native_group_norm.default, args, {}, 2)

