"""An fx graph under construction whose every node carries a fake value of its LOCAL shape."""
from __future__ import annotations

import dataclasses
import itertools
import operator
from typing import Any, Sequence

import torch
import torch.fx as fx

from autopar import _torch_compat as compat


class CodegenError(RuntimeError):
    """A node of the plan cannot be rewritten into a local program (an unsupported op/layout combination)."""


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
                     for k in range(2, len(axis_names) + 1) for axes in itertools.combinations(range(len(axis_names)), k))
        return cls(tuple(axis_names), tuple(axis_sizes), coords, tuple(f"autopar:{a}" for a in axis_names), device,
                   flat)

    def group_of_axes(self, axes: Sequence[int]) -> str | None:
        """The flattened group over `axes` (in mesh order), or None when this rank has none."""
        return dict(self.flat_groups).get(tuple(axes))

    def axis_of_group(self, group_name: str) -> str:
        """The axis name behind a group; "dp+tp" for a flattened group."""
        for axes, name in self.flat_groups:
            if name == group_name:
                return "+".join(self.axis_names[a] for a in axes)
        return self.axis_names[self.group_names.index(group_name)]


class Builder:
    """Appends nodes to a graph, running each op on fake tensors so shapes are known (and checked) as the
    local program is written."""

    def __init__(self) -> None:
        self.graph = fx.Graph()
        self.mode = compat.fake_tensor_mode()
        self.phase: dict[fx.Node, str] = {}
        self.constants: dict[str, torch.Tensor] = {}

    def constant(self, name: str, value: torch.Tensor) -> fx.Node:
        """A tensor the program holds (a constant the model built while tracing): the same on every rank."""
        self.constants[name] = value
        node = self.graph.get_attr(name)
        node.meta["val"] = self.mode.from_tensor(value)
        return node

    def module(self) -> fx.GraphModule:
        root = torch.nn.Module()
        for name, value in self.constants.items():
            root.register_buffer(name, value)
        return fx.GraphModule(root, self.graph)

    def placeholder(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> fx.Node:
        node = self.graph.placeholder(name)
        with self.mode:
            node.meta["val"] = torch.empty(tuple(shape), dtype=dtype, device="cpu")
        return node

    def call(self, target: Any, args: tuple, kwargs: dict | None = None, *, phase: str, name: str | None = None,
             fake_kwargs: dict | None = None) -> fx.Node:
        kwargs = dict(kwargs or {})
        node = self.graph.create_node("call_function", target, tuple(args), kwargs, name=name)
        fargs = fx.node.map_arg(tuple(args), lambda n: n.meta["val"])
        fkw = fx.node.map_arg(fake_kwargs if fake_kwargs is not None else kwargs, lambda n: n.meta["val"])
        try:
            with self.mode:
                node.meta["val"] = target(*fargs, **fkw) if target is not operator.getitem else fargs[0][fargs[1]]
        except Exception as e:  # noqa: BLE001 - name the op whose local version failed
            self.graph.erase_node(node)
            raise CodegenError(f"the local op {_op_name(target)}{_shapes(fargs)} failed on local shapes: "
                               f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
        self.phase[node] = phase
        return node

    def output(self, values: Any) -> fx.Node:
        return self.graph.output(values)


def _op_name(target: Any) -> str:
    return getattr(target, "__name__", None) if target is operator.getitem else str(target)


def _shapes(args: tuple) -> str:
    def one(a):
        if isinstance(a, torch.Tensor):
            return f"T{list(a.shape)}"
        if isinstance(a, (list, tuple)):
            return "[" + ", ".join(one(x) for x in a) + "]"
        return repr(a)

    return "(" + ", ".join(one(a) for a in args) + ")"


def local_val_shape(node: fx.Node) -> tuple[int, ...]:
    return tuple(int(s) for s in node.meta["val"].shape)
