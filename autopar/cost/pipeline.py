"""Pipeline schedules as event timelines: which stage runs which microbatch's forward, backward (full, or split
into input and weight gradients) when, on which pipeline rank, from per-stage times and point-to-point times.

The action order of each rank is the one torch.distributed.pipelining's schedule classes run
(`schedule_actions`, read from the class without a process group), so the simulation describes what the
runtime executes. `simulate` then list-schedules each rank's actions in that order: an action starts when its
rank is free and its inputs exist (the previous stage's forward of the microbatch plus the activation's
transfer, the next stage's backward plus the gradient's transfer, the stage's own forward, and for a weight
gradient its input gradient).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from autopar import _torch_compat as compat

# Schedule class -> (virtual stages per rank it takes: None for any >= 2, or a fixed count; splits backward).
SCHEDULES: dict[str, tuple[int | None, bool]] = {
    "ScheduleGPipe": (1, False),
    "Schedule1F1B": (1, False),
    "ScheduleInterleaved1F1B": (None, False),
    "ScheduleInterleavedZeroBubble": (None, True),
    "ScheduleZBVZeroBubble": (2, True),
}


class ScheduleError(ValueError):
    """A schedule that cannot run with the given stages and microbatches (the message says what to change)."""


@dataclasses.dataclass(frozen=True)
class Action:
    stage: int
    kind: str  # "F" forward, "B" full backward, "I" backward for the input, "W" backward for the weights
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


@dataclasses.dataclass(frozen=True)
class StageTimes:
    """Seconds one microbatch takes on one stage: forward, backward for its input, backward for its weights
    (a full backward takes both), and the point-to-point transfer of its output activation to the next stage
    (the gradient coming back is the same size and takes as long)."""

    forward: float
    backward_input: float
    backward_weight: float
    send: float = 0.0


@dataclasses.dataclass
class Timeline:
    """A simulated pipeline step: events (rank, action, start, end), the makespan, each rank's busy time and the
    most microbatches whose activations each rank holds at once (forward done, backward not)."""

    events: list[tuple[int, Action, float, float]]
    makespan: float
    busy: list[float]
    in_flight: list[int]
    stage_rank: dict[int, int]

    @property
    def idle_ratio(self) -> float:
        """Idle time over busy time, over all ranks: (p-1)/m for GPipe and 1F1B with equal stages."""
        idle = sum(self.makespan - b for b in self.busy)
        return idle / sum(self.busy)

    @property
    def bubble_fraction(self) -> float:
        """The share of the ranks' step spent idle."""
        return 1.0 - sum(self.busy) / (self.makespan * len(self.busy))

    def gantt(self) -> list[list]:
        """[lane, label, start, end] records for autopar.inspect's timeline plots, one lane per rank."""
        return [[f"pp rank {r}", str(a), s, e] for r, a, s, e in self.events]


def virtual_stages(schedule: str, requested: int | None = None) -> int:
    """The virtual stages per rank `schedule` runs: its fixed count, or `requested` (default 2) for the
    interleaved ones."""
    fixed, _ = _spec(schedule)
    if fixed is not None:
        if requested not in (None, fixed):
            raise ScheduleError(f"{schedule} runs {fixed} stage(s) per rank, not {requested}")
        return fixed
    v = 2 if requested is None else requested
    if v < 2:
        raise ScheduleError(f"{schedule} needs at least 2 virtual stages per rank, got {v}")
    return v


def splits_backward(schedule: str) -> bool:
    """Whether the schedule runs each backward as an input-gradient part and a weight-gradient part."""
    return _spec(schedule)[1]


def _spec(schedule: str) -> tuple[int | None, bool]:
    if schedule not in SCHEDULES:
        raise ScheduleError(f"unknown pipeline schedule {schedule!r}; autopar runs {', '.join(SCHEDULES)}")
    return SCHEDULES[schedule]


def schedule_actions(schedule: str, pp: int, microbatches: int, virtual: int | None = None) -> list[list[Action]]:
    """Per pipeline rank, its compute actions in the order the torch.distributed.pipelining class `schedule`
    runs them.

    Forward and backward microbatch indices are renumbered per stage in the order they run: every schedule runs
    a stage's microbatches in order, and torch's Schedule1F1B numbers the forwards of its last rank from 1 in
    the order it exports (its runtime loop runs them from 0)."""
    v = virtual_stages(schedule, virtual)
    if pp < 1 or microbatches < 1:
        raise ScheduleError(f"a pipeline needs at least one rank and one microbatch (pp={pp}, m={microbatches})")
    try:
        raw = compat.pipeline_schedule_order(schedule, pp, microbatches, v)
    except (ValueError, AssertionError, RuntimeError) as e:
        raise ScheduleError(f"{schedule} cannot run {microbatches} microbatches on {pp} ranks x {v} stages: "
                            f"{str(e).splitlines()[0]}") from e
    seen: dict[tuple[int, str], int] = {}
    out = []
    for rank in raw:
        actions = []
        for stage, kind, _ in rank:
            k = seen.get((stage, kind), 0)
            seen[(stage, kind)] = k + 1
            actions.append(Action(stage, kind, k))
        out.append(actions)
    _check_complete(out, pp * v, microbatches, splits_backward(schedule), schedule)
    return out


def _check_complete(ranks: list[list[Action]], stages: int, m: int, split: bool, schedule: str) -> None:
    kinds = ("F", "I", "W") if split else ("F", "B")
    want = {(s, k, i) for s in range(stages) for k in kinds for i in range(m)}
    got = [(a.stage, a.kind, a.microbatch) for r in ranks for a in r]
    if sorted(got) != sorted(want):
        raise ScheduleError(f"{schedule}'s order does not run every stage's {'/'.join(kinds)} of {m} microbatches "
                            "once; this schedule is not supported with these sizes")


def simulate(ranks: Sequence[Sequence[Action]], times: Sequence[StageTimes]) -> Timeline:
    """The event timeline of one step (see the module docstring). `times[s]` are stage s's times."""
    stage_rank = {a.stage: r for r, acts in enumerate(ranks) for a in acts}
    last = max(stage_rank)
    done: dict[tuple[int, str, int], float] = {}
    free = [0.0] * len(ranks)
    pos = [0] * len(ranks)
    events: list[tuple[int, Action, float, float]] = []
    busy = [0.0] * len(ranks)

    def ready(a: Action) -> float | None:
        deps: list[float | None] = []
        if a.kind == "F" and a.stage > 0:
            deps.append(_arrive(done, (a.stage - 1, "F", a.microbatch), stage_rank, a.stage - 1, a.stage, times))
        elif a.kind in ("B", "I"):
            deps.append(done.get((a.stage, "F", a.microbatch)))
            if a.stage < last:
                nxt = (a.stage + 1, "B", a.microbatch) if (a.stage + 1, "B", a.microbatch) in done else \
                    (a.stage + 1, "I", a.microbatch)
                deps.append(_arrive(done, nxt, stage_rank, a.stage + 1, a.stage, times))
        elif a.kind == "W":
            deps.append(done.get((a.stage, "I", a.microbatch)))
        if any(d is None for d in deps):
            return None
        return max(deps, default=0.0)

    remaining = sum(len(r) for r in ranks)
    while remaining:
        progress = False
        for r, acts in enumerate(ranks):
            while pos[r] < len(acts):
                a = acts[pos[r]]
                t = ready(a)
                if t is None:
                    break
                start = max(free[r], t)
                end = start + _duration(a, times[a.stage])
                done[(a.stage, a.kind, a.microbatch)] = end
                free[r] = end
                busy[r] += end - start
                events.append((r, a, start, end))
                pos[r] += 1
                remaining -= 1
                progress = True
        if not progress:
            stuck = {r: str(acts[pos[r]]) for r, acts in enumerate(ranks) if pos[r] < len(acts)}
            raise ScheduleError(f"the schedule deadlocks: ranks wait on {stuck}")
    events.sort(key=lambda e: (e[2], e[0]))
    return Timeline(events, max(free), busy, _in_flight(ranks), stage_rank)


def _arrive(done, key, stage_rank, src: int, dst: int, times) -> float | None:
    t = done.get(key)
    if t is None:
        return None
    boundary = min(src, dst)  # the activation of stage `boundary` to the next, or its gradient coming back
    return t + (times[boundary].send if stage_rank[src] != stage_rank[dst] else 0.0)


def _duration(a: Action, t: StageTimes) -> float:
    return {"F": t.forward, "B": t.backward_input + t.backward_weight, "I": t.backward_input,
            "W": t.backward_weight}[a.kind]


def _in_flight(ranks: Sequence[Sequence[Action]]) -> list[int]:
    """Per rank, the most microbatch activations held at once: a forward keeps its stage's activations until
    the microbatch's full backward, or its weight gradient when the backward is split."""
    out = []
    for acts in ranks:
        held = peak = 0
        for a in acts:
            held += 1 if a.kind == "F" else -1 if a.kind in ("B", "W") else 0
            peak = max(peak, held)
        out.append(peak)
    return out


def simulate_schedule(schedule: str, pp: int, microbatches: int, times: Sequence[StageTimes],
                      virtual: int | None = None) -> Timeline:
    """`simulate` of the schedule's own action order; `times` has one entry per stage (pp x virtual)."""
    ranks = schedule_actions(schedule, pp, microbatches, virtual)
    stages = pp * virtual_stages(schedule, virtual)
    if len(times) != stages:
        raise ScheduleError(f"{schedule} on {pp} ranks runs {stages} stages; got times for {len(times)}")
    return simulate(ranks, times)


__all__ = ["SCHEDULES", "ScheduleError", "Action", "StageTimes", "Timeline", "schedule_actions", "simulate",
           "simulate_schedule", "virtual_stages", "splits_backward"]
