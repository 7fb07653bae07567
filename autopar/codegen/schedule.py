"""Clean-up and collective scheduling on one rank's generated forward or backward graph.

`simplify` removes nodes that compute nothing once the graph runs outside autograd (detach, a transpose of a
transpose, a view to the same shape, x ** 1): the graphs run eagerly, one Python-dispatched op per node, so
every node removed is dispatch time saved.

`overlap_collectives` issues each collective as early as its input allows and waits on it as late as its first
user allows, so its latency hides behind the computation in between (on gloo and NCCL alike the collective
runs in the background between issue and wait). Issue points move only through cheap data-movement ops (a
slice and a copy of the labels, say), never through compute, and collectives whose input derives from a
parameter keep their place: those are the parameter gathers whose timing codegen chose (one bucket ahead),
and gathering them earlier would hold full weights longer. No collective moves past another, so every rank
issues them in the order codegen emitted.
"""
from __future__ import annotations

import operator
from typing import Iterable

import torch
import torch.fx as fx

from autopar import _torch_compat as compat
from autopar.codegen.collectives import collective_kind

aten = torch.ops.aten

_SAME_SHAPE_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default,
                     aten.alias.default)
# Data movement a collective's input may be hoisted through (never compute).
_CHEAP = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.slice.Tensor,
          aten.clone.default, aten._to_copy.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
          aten.t.default, aten.transpose.int, aten.permute.default, aten.expand.default, aten.select.int,
          aten.alias.default, aten.detach.default, aten.cat.default, aten.split.Tensor,
          aten.split_with_sizes.default, operator.getitem}


def _val(n) -> torch.Tensor | None:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _same_value(node: fx.Node) -> fx.Node | None:
    """The node whose value `node` merely repeats, or None."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    x, t = node.args[0], node.target
    src = None
    if t is aten.detach.default or t in _SAME_SHAPE_VIEWS:
        src = x
    elif t is aten.t.default and x.op == "call_function" and x.target is aten.t.default:
        src = x.args[0]
    elif t is aten.transpose.int and x.op == "call_function" and x.target is aten.transpose.int:
        rank = _val(node).dim() if _val(node) is not None else 0
        if rank and {d % rank for d in node.args[1:3]} == {d % rank for d in x.args[1:3]}:
            src = x.args[0]
    elif t is aten.pow.Tensor_Scalar and node.args[1] == 1:
        src = x
    out, inp = _val(node), _val(src)
    if out is None or inp is None or out.dtype != inp.dtype or tuple(out.shape) != tuple(inp.shape):
        return None
    return src


def simplify(graph: fx.Graph) -> int:
    """Replace no-op nodes by the value they repeat; returns how many nodes were removed."""
    removed = 0
    for node in list(graph.nodes):
        src = _same_value(node)
        if src is None:
            continue
        inner = node.args[0]
        node.replace_all_uses_with(src)
        graph.erase_node(node)
        removed += 1
        if inner is not src and not inner.users:  # t(t(x)): the inner transpose, now read by nothing
            graph.erase_node(inner)
            removed += 1
    return removed


def _is_wait(n: fx.Node) -> bool:
    return compat.op_namespace_and_name(n.target) == ("_c10d_functional", "wait_tensor")


def overlap_collectives(graph: fx.Graph, params: Iterable[str]) -> None:
    """Move collective issues early and their waits late (see the module doc). `params`: the names of the
    placeholders holding parameter values; collectives reading them keep their place."""
    params = set(params)
    from_param: dict[fx.Node, bool] = {}
    for n in graph.nodes:
        from_param[n] = (n.op == "placeholder" and n.name in params) or any(from_param[a] for a in n.all_input_nodes)
    nodes = list(graph.nodes)
    for c in [n for n in nodes if n.op == "call_function" and collective_kind(n) is not None]:
        if not from_param[c]:
            _hoist(graph, c)
    for w in [n for n in graph.nodes if n.op == "call_function" and _is_wait(n)]:
        _sink(graph, w)


def _position(graph: fx.Graph) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def _hoist(graph: fx.Graph, node: fx.Node) -> None:
    """Move `node` right after the last of its inputs, hoisting cheap input producers first."""
    for a in node.all_input_nodes:
        if a.op == "call_function" and a.target in _CHEAP:
            _hoist(graph, a)
    pos = _position(graph)
    inputs = node.all_input_nodes
    if not inputs:
        return
    last = max(inputs, key=pos.__getitem__)
    if last.op == "placeholder":  # placeholders stay first
        last = max((n for n in graph.nodes if n.op == "placeholder"), key=pos.__getitem__)
    if collective_kind(node) is not None:
        # Collectives keep their issue order: ranks match collectives by order, and the local graphs of
        # different ranks may differ in the local ops around them (uneven shards), never in that order.
        before = [n for n in graph.nodes if pos[n] < pos[node] and n.op == "call_function"
                  and collective_kind(n) is not None]
        if before and pos[before[-1]] > pos[last]:
            last = before[-1]
    if pos[last] + 1 < pos[node]:
        last.append(node)


def _sink(graph: fx.Graph, wait: fx.Node) -> None:
    """Move a wait right before its first user."""
    if not wait.users:
        return
    pos = _position(graph)
    first = min(wait.users, key=pos.__getitem__)
    if first.op != "output" and pos[first] > pos[wait] + 1:
        first.prepend(wait)


__all__ = ["simplify", "overlap_collectives"]
