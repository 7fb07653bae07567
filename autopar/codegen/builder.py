"""An fx graph under construction whose every node carries a fake value of its LOCAL shape."""
from __future__ import annotations

import operator
from typing import Any, Sequence

import torch
import torch.fx as fx

from autopar import _torch_compat as compat
from autopar.program import RankSpec  # noqa: F401 - codegen's callers name it from here too


class CodegenError(RuntimeError):
    """A node of the plan cannot be rewritten into a local program (an unsupported op/layout combination)."""


class Builder:
    """Appends nodes to a graph, running each op on fake tensors so shapes are known (and checked) as the
    local program is written."""

    def __init__(self) -> None:
        self.graph = fx.Graph()
        self.mode = compat.fake_tensor_mode()
        self.phase: dict[fx.Node, str] = {}
        self.constants: dict[str, torch.Tensor] = {}
        self.recompute: set[fx.Node] = set()  # nodes of activation-checkpointed regions (see partition)
        self.in_checkpoint = False  # set while lowering a checkpointed node: what it emits is recomputed too
        self.log: list[fx.Node] | None = None  # where set, every node emitted is appended to it

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
        if self.in_checkpoint:
            self.recompute.add(node)
        if self.log is not None:
            self.log.append(node)
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
