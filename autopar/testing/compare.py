"""Compare a parallel training run with the single-device run tensor by tensor, at tolerances scaled to each tensor.

Elementwise, |got - want| <= atol + RTOL * |want| with atol = ATOL_SCALE * max|want| of that tensor, not below a
floor for its kind:

- gradients: the floor is GRAD_FLOOR_SCALE (1e-8) times the largest gradient entry of the step. A gradient whose
  entries are all around 1e-6 (BERT's query weights and biases) is held to its own scale, where a fixed atol of
  1e-5 passes anything, even zeros; only a gradient that is zero in exact arithmetic (a key-projection bias,
  which softmax ignores: rounding noise of 1e-12 to 3e-10 here, 5e-10 of the largest entry at most) is left to
  the floor.
- weights: their updates (after - before, in float64) are compared, not the weights, so a norm weight of 1.0 is
  held to its update of about 1e-3 rather than to its value. AdamW amplifies gradient rounding: an entry whose
  gradient is near eps moves by lr * g / (|g| + eps), which changes by up to lr / (4 eps) per unit of g (250
  at lr 1e-3, eps 1e-6), and the differences compound over steps: updates differ by up to 3.5e-4 of the
  tensor's largest update in correct runs (measured). Their atol is UPDATE_ATOL_SCALE (3e-3) times the largest
  update of the tensor, not below
  UPDATE_FLOOR_LR (1e-3) times the learning rate (a weight whose gradient is zero up to rounding moves by noise
  of up to 7e-8 here). A wrong gradient moves weights by whole fractions of lr.
- losses and other scalars: rtol and atol 1e-4 of the value.

`ratio` is how far a tensor is from failing: the largest |got - want| / (atol + RTOL * |want|) over its elements
(above 1 fails). `assert_all_close(pairs)` checks every (what, got, want[, floor]) and raises one `Mismatch`
naming every tensor that differs (worst first), so a broken collective shows which values it touched. With the
environment variable AUTOPAR_TEST_ERROR_LOG set to a path, every comparison appends a line
`test  what  max|want|  max|got-want|  ratio` to it (to measure how tight the tolerances are across a run).
"""
from __future__ import annotations

import math
import os
from typing import Iterable, Mapping

import torch

RTOL = 1e-4
ATOL_SCALE = 1e-4
GRAD_FLOOR_SCALE = 1e-8
UPDATE_ATOL_SCALE = 3e-3
UPDATE_FLOOR_LR = 1e-3


class Mismatch(AssertionError):
    """Values differ from the reference: `failed` lists (ratio to the tolerance, what) of each, worst first."""

    def __init__(self, message: str, failed: list[tuple[float, str]]):
        super().__init__(message)
        self.failed = failed


def tolerance(want: torch.Tensor, floor: float = 0.0) -> tuple[float, float]:
    """(rtol, atol) for comparing with the reference tensor `want`."""
    scale = float(want.detach().abs().max()) if want.numel() else 0.0
    return RTOL, max(ATOL_SCALE * scale, floor, 1e-30)


def error_ratio(got: torch.Tensor, want: torch.Tensor, floor: float = 0.0) -> float:
    """Largest |got - want| / (atol + rtol * |want|): at most 1 passes. inf for a shape, dtype or NaN mismatch."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return math.inf
    if not want.numel():
        return 0.0
    rtol, atol = tolerance(want, floor)
    g, w = got.detach().double(), want.detach().double()
    if not torch.equal(torch.isnan(g), torch.isnan(w)):
        return math.inf
    diff = (g - w).abs().nan_to_num(0.0)
    return float((diff / (atol + rtol * w.abs().nan_to_num(0.0))).max())


def grad_pairs(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor], suffix: str = "") -> list[tuple]:
    """(what, got, want, floor) per gradient; the names must agree."""
    assert set(got) == set(want), f"gradients of other parameters: {sorted(set(got) ^ set(want))}"
    floor = GRAD_FLOOR_SCALE * max((float(g.abs().max()) for g in want.values() if g.numel()), default=0.0)
    return [(f"grad of {k}{suffix}", got[k], want[k], floor) for k in want]


def update_pairs(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor],
                 before: Mapping[str, torch.Tensor], lr: float, suffix: str = "") -> list[tuple]:
    """(what, got update, wanted update, floor) per weight, from the weights after the steps and before them."""
    assert set(got) == set(want), f"other parameters: {sorted(set(got) ^ set(want))}"
    pairs = []
    for k in want:
        have, ref = got[k].double() - before[k].double(), want[k].double() - before[k].double()
        atol = max(UPDATE_ATOL_SCALE * float(ref.abs().max()) if ref.numel() else 0.0, UPDATE_FLOOR_LR * lr)
        pairs.append((f"update of {k}{suffix}", have, ref, atol))
    return pairs


def describe(what: str, got: torch.Tensor, want: torch.Tensor, floor: float = 0.0) -> str:
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{what}: got {tuple(got.shape)} {got.dtype}, want {tuple(want.shape)} {want.dtype}"
    rtol, atol = tolerance(want, floor)
    diff = (got.detach().double() - want.detach().double()).abs()
    bad = diff > atol + rtol * want.detach().double().abs()
    i = int(diff.argmax()) if diff.numel() else 0
    return (f"{what}: {int(bad.sum())} of {want.numel()} elements differ; largest difference "
            f"{float(diff.max()):.3g} at index {i} (got {float(got.flatten()[i]):.6g}, want "
            f"{float(want.flatten()[i]):.6g}); atol {atol:.3g}, rtol {rtol:g}, "
            f"{error_ratio(got, want, floor):.3g}x the tolerance")


def assert_all_close(pairs: Iterable[tuple]) -> float:
    """Check every (what, got, want[, floor]); raise one AssertionError listing each mismatch, worst first.
    Returns the worst ratio (at most 1 when everything passes)."""
    worst, failures = 0.0, []
    log = os.environ.get("AUTOPAR_TEST_ERROR_LOG")
    lines = []
    for what, got, want, *rest in pairs:
        floor = rest[0] if rest else 0.0
        got, want = torch.as_tensor(got), torch.as_tensor(want)
        ratio = error_ratio(got, want, floor)
        worst = max(worst, ratio)
        if log:
            scale = float(want.abs().max()) if want.numel() else 0.0
            diff = float((got.double() - want.double()).abs().max()) if ratio != math.inf and want.numel() else math.inf
            lines.append(f"{os.environ.get('PYTEST_CURRENT_TEST', '').split(' ')[0]}\t{what}\t{scale:.3e}\t"
                         f"{diff:.3e}\t{ratio:.3e}\n")
        if not ratio <= 1.0:
            failures.append((ratio, what, describe(what, got, want, floor)))
    if lines:
        with open(log, "a") as f:
            f.writelines(lines)
    if failures:
        failures.sort(key=lambda f: -f[0])
        raise Mismatch(f"{len(failures)} tensors differ from the reference (worst {failures[0][0]:.3g}x the "
                       "tolerance):\n  " + "\n  ".join(d for _, _, d in failures[:20])
                       + (f"\n  ... and {len(failures) - 20} more" if len(failures) > 20 else ""),
                       [(r, w) for r, w, _ in failures])
    return worst
