"""Pipeline stages priced from per-layer figures: balanced cuts of L identical layers into stages (the first
stage also runs what precedes the layers, the embedding; the last what follows them, the head and loss),
and one schedule's step time and per-rank memory from the event timeline of autopar.cost.pipeline."""
from __future__ import annotations

import dataclasses
import math

from autopar.cost.pipeline import (ScheduleError, StageTimes, Timeline, schedule_actions, simulate,
                                   virtual_stages)


@dataclasses.dataclass(frozen=True)
class Part:
    """Per microbatch: forward, backward-input and backward-weight seconds and the bytes kept from forward to
    backward; per step: the gradient reductions' and optimizer's seconds and the persistent bytes (parameters,
    gradients, optimizer state). For one layer, or for what precedes or follows the layers."""

    forward: float = 0.0
    backward_input: float = 0.0
    backward_weight: float = 0.0
    saved: float = 0.0
    grad_sync: float = 0.0
    optimizer: float = 0.0
    static: float = 0.0

    @property
    def time(self) -> float:
        return self.forward + self.backward_input + self.backward_weight

    def times(self, n: float, other: "Part | None" = None, extra: "Part | None" = None) -> "Part":
        """n of this part plus the extra parts."""
        fields = [f.name for f in dataclasses.fields(Part)]
        out = {f: n * getattr(self, f) for f in fields}
        for e in (other, extra):
            if e is not None:
                for f in fields:
                    out[f] += getattr(e, f)
        return Part(**out)


@dataclasses.dataclass(frozen=True)
class Model:
    """What the stage planner knows of a model under fixed placements."""

    layers: int
    layer: Part
    first: Part  # before the layers (embedding)
    last: Part  # after them (norm, head, loss)
    send: float  # seconds to send one microbatch's activations between stages (the gradient back: the same)
    transient: float  # working bytes of one microbatch's step beyond the saved activations, on every rank


def balanced_cuts(model: Model, stages: int) -> list[int]:
    """Layers per stage (each at least one) minimizing the longest stage's time, the first stage carrying
    `model.first` and the last `model.last`; ties go to the first such split (dynamic programming)."""
    n, layer = model.layers, model.layer.time
    if stages > n:
        raise ScheduleError(f"{stages} pipeline stages need at least {stages} repeated layers; the model has {n}: "
                            "use a shorter pipeline axis or fewer virtual stages")

    def extra(s: int) -> float:
        return (model.first.time if s == 0 else 0.0) + (model.last.time if s == stages - 1 else 0.0)

    inf = math.inf
    # best[s][j]: the smallest longest-stage time of stages 0..s-1 holding layers 0..j-1; arg: its last stage.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    arg = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for j in range(s, n - (stages - s) + 1):
            for k in range(1, j - (s - 1) + 1):
                t = max(best[s - 1][j - k], k * layer + extra(s - 1))
                if t < best[s][j] - 1e-15:
                    best[s][j], arg[s][j] = t, k
    counts, j = [], n
    for s in range(stages, 0, -1):
        counts.append(arg[s][j])
        j -= arg[s][j]
    return counts[::-1]


def stage_parts(model: Model, counts: list[int]) -> list[Part]:
    last = len(counts) - 1
    return [model.layer.times(c, model.first if s == 0 else None, model.last if s == last else None)
            for s, c in enumerate(counts)]


@dataclasses.dataclass
class Candidate:
    """One schedule priced: its step time, the timeline, and per pipeline rank the peak memory."""

    schedule: str
    virtual: int
    counts: list[int]
    parts: list[Part]
    timeline: Timeline
    step_time: float
    memory: list[float]
    memory_parts: list[dict[str, float]]

    @property
    def peak_memory(self) -> float:
        return max(self.memory)


def price(model: Model, schedule: str, pp: int, microbatches: int, virtual: int | None = None) -> Candidate:
    """A schedule's step on balanced cuts: the simulated timeline of the microbatches, then on each rank its
    stages' gradient reductions and optimizer step; memory per rank is its stages' persistent bytes plus the
    saved activations of the microbatches it holds at once in this schedule's order, plus the transient."""
    v = virtual_stages(schedule, virtual)
    counts = balanced_cuts(model, pp * v)
    parts = stage_parts(model, counts)
    ranks = schedule_actions(schedule, pp, microbatches, v)
    times = [StageTimes(p.forward, p.backward_input, p.backward_weight, model.send) for p in parts]
    tl = simulate(ranks, times)
    stages_of = [sorted({a.stage for a in acts}) for acts in ranks]
    tail = [sum(parts[s].grad_sync + parts[s].optimizer for s in ss) for ss in stages_of]
    memory, breakdown = [], []
    for acts, ss in zip(ranks, stages_of):
        static = sum(parts[s].static for s in ss)
        held = {s: 0 for s in ss}
        peak = cur = 0.0
        for a in acts:  # a forward keeps its stage's activations until the (weight) backward frees them
            if a.kind == "F":
                held[a.stage] += 1
                cur += parts[a.stage].saved
            elif a.kind in ("B", "W"):
                held[a.stage] -= 1
                cur -= parts[a.stage].saved
            peak = max(peak, cur)
        memory.append(static + peak + model.transient)
        breakdown.append({"static": static, "activations": peak + model.transient})
    return Candidate(schedule, v, counts, parts, tl, tl.makespan + max(tail), memory, breakdown)


__all__ = ["Part", "Model", "balanced_cuts", "stage_parts", "Candidate", "price"]
