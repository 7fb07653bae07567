"""Split a stage's backward graph into the part zero-bubble schedules run first, the gradients of the stage's
inputs (so the previous stage can go on), and the part they run later, the weight gradients.

`backward(*saved, *tangents) -> (*param grads, *input grads)` becomes
`backward_input(*saved, *tangents) -> (*input grads, *carried)` and
`backward_weight(*saved, *tangents, *carried) -> (*param grads)`, where `carried` are the values the first part
computes that the second reads (a gradient flowing into a weight's matmul, say). Nodes both need run once, in
the first part.
"""
from __future__ import annotations

import torch.fx as fx


def split_backward(backward: fx.GraphModule, n_params: int) -> tuple[fx.GraphModule, fx.GraphModule]:
    graph = backward.graph
    out = next(n for n in graph.nodes if n.op == "output")
    values = list(out.args[0])
    param_grads, input_grads = values[:n_params], values[n_params:]
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    first = _ancestors([g for g in input_grads if isinstance(g, fx.Node)])
    second = _ancestors([g for g in param_grads if isinstance(g, fx.Node)]) - first
    carried = [n for n in graph.nodes if n in first and n.op != "placeholder"
               and any(u in second for u in n.users)]
    carried += [g for g in param_grads if isinstance(g, fx.Node) and g in first and g.op != "placeholder"
                and g not in carried]

    g1, env1 = fx.Graph(), {}
    for p in placeholders:
        env1[p] = _copy(g1, p, env1)
    for n in graph.nodes:
        if n in first and n.op not in ("placeholder", "output"):
            env1[n] = _copy(g1, n, env1)
    g1.output((*[_get(env1, g) for g in input_grads], *[env1[c] for c in carried]))

    g2, env2 = fx.Graph(), {}
    for p in placeholders:
        env2[p] = _copy(g2, p, env2)
    for c in carried:
        ph = g2.placeholder(f"carried_{c.name}")
        ph.meta = dict(c.meta)
        env2[c] = ph
    for n in graph.nodes:
        if n in second and n.op not in ("placeholder", "output") and n not in env2:
            env2[n] = _copy(g2, n, env2)
    g2.output(tuple(_get(env2, g) for g in param_grads))
    parts = []
    for g in (g1, g2):
        g.eliminate_dead_code()
        g.lint()
        parts.append(fx.GraphModule(backward, g))
    return parts[0], parts[1]


def _ancestors(roots: list[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = list(roots)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def _copy(dst: fx.Graph, node: fx.Node, env: dict) -> fx.Node:
    new = dst.node_copy(node, lambda a: env[a])
    new.meta = dict(node.meta)
    return new


def _get(env: dict, g):
    return env[g] if isinstance(g, fx.Node) else g


__all__ = ["split_backward"]
