"""Program: one rank's generated step (forward and backward graphs over local shards) as plain data, the only
thing the runtime reads.

Codegen (`autopar.codegen.generate`) returns it; `autopar.inspect.format_program` prints it (`print(program)`,
`autopar program plan.json --rank R`, `pm.program(rank)`) so a user can read what a rank will run, with its
collectives in issue order, their process groups and the gradient and parameter buckets, before launching.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor import Placement

from autopar.plan import Plan

Layout = tuple[Placement, ...]


def flat_combinations(n: int) -> list[tuple[int, ...]]:
    """Every combination of two or more of n mesh axes, in mesh order: the flattened groups a rank holds."""
    return [axes for k in range(2, n + 1) for axes in itertools.combinations(range(n), k)]


@dataclasses.dataclass(frozen=True)
class RankSpec:
    """What codegen needs to know of one rank: mesh axes, this rank's coordinate on each, and the
    process-group name behind each axis (placeholder names for fake meshes)."""

    axis_names: tuple[str, ...]
    axis_sizes: tuple[int, ...]
    coords: tuple[int, ...]
    group_names: tuple[str, ...]
    device: str = "cpu"
    # (axes, group name) of the flattened groups over several axes this rank belongs to, e.g. ((0, 1), name):
    # data parallelism over those axes reduces a gradient bucket once over it instead of once per axis.
    flat_groups: tuple[tuple[tuple[int, ...], str], ...] = ()

    def __post_init__(self):
        n = len(self.axis_names)
        if not (len(self.axis_sizes) == len(self.coords) == len(self.group_names) == n):
            raise ValueError(f"RankSpec: {n} axes but sizes {self.axis_sizes}, coords {self.coords}, "
                             f"groups {self.group_names}")
        for name, c, s in zip(self.axis_names, self.coords, self.axis_sizes):
            if not 0 <= c < s:
                raise ValueError(f"coordinate {c} on axis {name!r} is outside the axis size {s}")

    @classmethod
    def fake(cls, axis_names: Sequence[str], axis_sizes: Sequence[int], coords: Sequence[int] | None = None,
             device: str = "cpu") -> "RankSpec":
        """A rank of a mesh with no process groups: group names are placeholders `autopar:<axis>`."""
        coords = tuple(coords) if coords is not None else tuple(0 for _ in axis_names)
        flat = tuple((axes, "autopar:" + "+".join(axis_names[a] for a in axes))
                     for axes in flat_combinations(len(axis_names)))
        return cls(tuple(axis_names), tuple(axis_sizes), coords, tuple(f"autopar:{a}" for a in axis_names), device,
                   flat)

    @classmethod
    def of_rank(cls, axis_names: Sequence[str], axis_sizes: Sequence[int], rank: int,
                device: str = "cpu") -> "RankSpec":
        """The fake RankSpec of global rank `rank` (row-major over the mesh, as init_device_mesh numbers it)."""
        total = 1
        for s in axis_sizes:
            total *= s
        if not 0 <= rank < total:
            raise ValueError(f"rank {rank} is outside the mesh {dict(zip(axis_names, axis_sizes))} of {total} ranks")
        coords, rest = [], rank
        for s in reversed(tuple(axis_sizes)):
            coords.append(rest % s)
            rest //= s
        return cls.fake(axis_names, axis_sizes, tuple(reversed(coords)), device)

    @property
    def rank(self) -> int:
        """This rank's global number (row-major over the mesh)."""
        r = 0
        for c, s in zip(self.coords, self.axis_sizes):
            r = r * s + c
        return r

    def group_of_axes(self, axes: Sequence[int]) -> str | None:
        """The flattened group over `axes` (in mesh order), or None when this rank has none."""
        return dict(self.flat_groups).get(tuple(axes))

    def axis_of_group(self, group_name: str) -> str:
        """The axis name behind a group; "dp+tp" for a flattened group."""
        for axes, name in self.flat_groups:
            if name == group_name:
                return "+".join(self.axis_names[a] for a in axes)
        return self.axis_names[self.group_names.index(group_name)]


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A parameter, buffer or input of the program: global shape, this rank's local shape, dtype, layout
    (placements in mesh_dim_names order)."""

    name: str
    shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    dtype: torch.dtype
    layout: Layout
    # Inputs only: the index of this tensor among the call's flattened (args, kwargs).
    leaf: int | None = None


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective the program issues: which graph, the node, the kind, the axes of its process group, the
    bytes it sends in, and the parameters or gradients of the bucket it carries (empty for one value)."""

    graph: str  # "forward" | "backward" | "grad_sync"
    node: str
    kind: str  # all_gather | all_reduce | reduce_scatter | all_to_all
    axes: str  # "tp", or "dp+tp" for a flattened group
    group: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    bucket: tuple[str, ...] = ()
    value: str = ""  # what is redistributed, for a single value

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize


@dataclasses.dataclass
class Program:
    """One rank's step: `forward(*params, *buffers, *inputs[, rng_seed]) -> (loss, *new buffer values, *outputs,
    *saved)` and `backward(*saved, *tangents) -> (grad per param or None)`, with the specs to call them. The new
    values are those of `buffer_updates` (batch norm running statistics, counters), in their buffers' layouts:
    the caller writes them into its buffers. `outputs` are the step's other results (when the loss function
    returns `(loss, *outputs)`), each this rank's piece in its planned layout (TensorSpec), never differentiated.

    Eval programs (forward only) have an empty backward. `takes_seed`: forward takes the dropout step seed of
    codegen/rng.py last (an int, or a 0-d int64 tensor in the functional form, `seed_as_tensor`).

    With several microbatches (`microbatches` > 1) the inputs are one microbatch's, `backward` returns each
    gradient in the layout it is produced in (no collective), to be accumulated over the microbatches, and
    `grad_sync(*accumulated gradients of the parameters in `synced`) -> (each in its parameter's layout)` runs
    the gradient collectives once per step. `loss_reduction` says how microbatch losses add up
    (autopar.microbatch.REDUCTIONS); with `returns_count` the forward's output ends with the loss's count
    (after the other outputs, before the saved tensors), by which the microbatches are weighed."""

    plan: Plan
    rank: RankSpec
    forward: fx.GraphModule
    backward: fx.GraphModule
    params: list[TensorSpec]
    buffers: list[TensorSpec]
    inputs: list[TensorSpec]
    saved: list[str]
    recomputed: list[str]
    collectives: list[Collective]
    buffer_updates: list[str] = dataclasses.field(default_factory=list)
    outputs: list[TensorSpec] = dataclasses.field(default_factory=list)
    takes_seed: bool = False
    seed_as_tensor: bool = False
    forward_only: bool = False
    joint: Any = None  # the local joint graph before the split (codegen's LocalJoint), for debugging
    microbatches: int = 1
    grad_sync: fx.GraphModule | None = None
    synced: list[str] = dataclasses.field(default_factory=list)
    loss_reduction: str = "mean"
    returns_count: bool = False
    # A pipeline stage's program (plan.pipeline): its stage index, the activations it receives from the previous
    # stage (forward inputs after `inputs`; the backward returns their gradients after the parameters') and
    # those it sends to the next (the forward's first outputs, instead of the loss; empty for the last stage,
    # which returns the loss and takes the loss's tangent).
    stage: int | None = None
    activations_in: list[TensorSpec] = dataclasses.field(default_factory=list)
    activations_out: list[TensorSpec] = dataclasses.field(default_factory=list)
    # Zero-bubble schedules (autopar/codegen/split_backward.py): `backward` split into
    # backward_input(*saved, *tangents) -> (*input grads, *carried) and
    # backward_weight(*saved, *tangents, *carried) -> (*param grads).
    backward_input: fx.GraphModule | None = None
    backward_weight: fx.GraphModule | None = None

    @property
    def param_names(self) -> list[str]:
        return [p.name for p in self.params]

    @property
    def buffer_names(self) -> list[str]:
        return [b.name for b in self.buffers]

    def code(self) -> str:
        """The generated graphs as Python text."""
        text = f"# forward\n{self.forward.code.strip()}\n\n# backward\n{self.backward.code.strip()}\n"
        if self.backward_input is not None:
            text += f"\n# backward_input (zero-bubble schedules: the input gradients first)\n" \
                    f"{self.backward_input.code.strip()}\n\n# backward_weight (then the weight gradients)\n" \
                    f"{self.backward_weight.code.strip()}\n"
        if self.grad_sync is not None:
            text += f"\n# grad_sync (once per step, after the last of {self.microbatches} microbatches)\n" \
                    f"{self.grad_sync.code.strip()}\n"
        return text

    def __str__(self) -> str:
        from autopar.inspect import format_program

        return format_program(self)


__all__ = ["RankSpec", "TensorSpec", "Collective", "Program"]
