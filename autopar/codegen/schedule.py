"""Clean-up of one rank's generated forward or backward graph.

`simplify` removes nodes that compute nothing once the graph runs outside autograd (detach, a transpose of a
transpose, a view to the same shape, x ** 1): the graphs run eagerly, one Python-dispatched op per node, so
every node removed is dispatch time saved.

`functional` copies a generated graph with its in-place collectives (a gradient bucket the program owns is
all-reduced in place) replaced by their out-of-place forms: compilers take functional graphs only (inductor's
compile_fx functionalizes its input and refuses an op that returns an alias of its input). Its dropout takes
the step seed as a tensor.
"""
from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten

_SAME_SHAPE_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default,
                     aten.alias.default)


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


# Data movement the input chain of a hoisted collective may consist of (never compute).
_MOVES = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.slice.Tensor,
          aten.clone.default, aten.unsqueeze.default, aten.squeeze.dims, aten.alias.default}


def issue_input_collectives_early(graph: fx.Graph, inputs: set[str]) -> int:
    """Move each collective that reads the program's inputs through data movement only (the labels' gather a
    global token count needs) up to right after the placeholders, or after the last collective issued before
    it, so it runs while the forward computes; its wait stays where it was. Collectives never pass each
    other: every rank issues them in the order lowering emitted. Returns how many moved."""
    from autopar.codegen.collectives import collective_kind

    anchor = [n for n in graph.nodes if n.op == "placeholder"][-1]
    moved = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or collective_kind(node) is None:
            continue
        chain, ok, stack = set(), True, list(node.all_input_nodes)
        while stack and ok:
            a = stack.pop()
            if a.op == "placeholder":
                ok = a.name in inputs
            elif a.op == "call_function" and a.target in _MOVES:
                if a not in chain:
                    chain.add(a)
                    stack.extend(a.all_input_nodes)
            else:
                ok = False
        if ok:
            order = {n: i for i, n in enumerate(graph.nodes)}
            # Only nodes after the anchor move (up); the chain's nodes before it are early enough already.
            for a in sorted((a for a in chain if order[a] > order[anchor]), key=order.__getitem__) + [node]:
                anchor.append(a)
                anchor = a
            moved += 1
        else:
            anchor = node
    return moved


def functional(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of `gm` computing the same values with no in-place collective, and dropout reading its step
    seed (the `rng_seed` input) from a 0-d int64 tensor instead of an int, which a compiler would specialize
    on and recompile for every step."""
    from autopar import _torch_compat as compat
    from autopar.codegen import rng

    c10d = compat.c10d_functional_ops()
    out_of_place = {c10d.all_reduce_.default: c10d.all_reduce.default, rng.SEEDED_DROPOUT: rng.SEEDED_DROPOUT_T}
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    for node in graph.nodes:
        if node.op == "call_function" and node.target in out_of_place:
            node.target = out_of_place[node.target]
    return fx.GraphModule(gm, graph)


__all__ = ["simplify", "issue_input_collectives_early", "functional"]
