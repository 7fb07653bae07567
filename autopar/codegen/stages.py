"""Cut a captured joint graph into pipeline stages: per stage, a Captured of its own nodes, which codegen lowers
into that stage's Program like any other.

A stage runs the layers the plan gives it (plan.pipeline.stage_layers), the first stage also what precedes them
and the last what follows them (autopar.sides). Values computed from graph inputs alone are recomputed by every
stage that reads them. A forward value one stage sends the next becomes a placeholder of the receiving stage
(`stage_inputs`, named `activation/<k>`) and an output of the sending one (`stage_outputs`); the gradient of it
that the receiving stage's backward computes becomes an output of that backward (`input_grads`, in the order of
its stage_inputs) and a tangent of the sending stage (`tangent/activation.<k>`). An activation crosses in its
producer's planned layout and its gradient in the same layout (PipelineStage sends back a gradient shaped like
the activation): the receiving stage brings the gradient there from where it computes it, the sending stage from
there to where its backward reads it. The loss, its count and the other outputs belong to
the last stage.
"""
from __future__ import annotations

import dataclasses

import torch.fx as fx

from autopar.capture import Captured
from autopar.codegen.builder import CodegenError
from autopar.plan import NodePlan, Plan
from autopar.sides import node_sides, sources


@dataclasses.dataclass
class StageCut:
    """Stage s's capture and the plan entries of its boundary placeholders (their producers' layouts)."""

    stage: int
    captured: Captured
    plan: Plan


def stage_of(cap: Captured, plan: Plan) -> dict[fx.Node, int]:
    """The stage of every node that is not a source (see autopar.sides.sources)."""
    pp = plan.pipeline
    layer_stage = {i: s for s, (a, b) in enumerate(pp.stage_layers) for i in range(a, b)}
    side, src, last = node_sides(cap), sources(cap), pp.stages - 1
    out = {}
    for n in cap.gm.graph.nodes:
        if n.op != "call_function" or n in src:
            continue
        out[n] = layer_stage[cap.block_of[n][1]] if n in cap.block_of else (0 if side[n] == "first" else last)
    return out


def cut_stages(cap: Captured, plan: Plan) -> list[StageCut]:
    """Every stage's capture (see the module docstring)."""
    if plan.pipeline is None:
        raise ValueError("the plan has no pipeline stages")
    stage = stage_of(cap, plan)
    src = sources(cap)
    S = plan.pipeline.stages
    order = {n: i for i, n in enumerate(cap.gm.graph.nodes)}
    act: list[list[fx.Node]] = [[] for _ in range(S)]  # act[s]: forward values stage s receives from s - 1
    grad: list[list[fx.Node]] = [[] for _ in range(S)]  # grad[s]: backward values stage s receives from s + 1
    for n, s in stage.items():
        for a in n.all_input_nodes:
            if a in src or stage[a] == s:
                continue
            t = stage[a]
            if cap.phase[a] == "fwd" and t == s - 1:
                act[s].append(a) if a not in act[s] else None
            elif cap.phase[a] == "bwd" and t == s + 1:
                grad[s].append(a) if a not in grad[s] else None
            else:
                raise ValueError(f"{cap.names[n]} (stage {s}) reads {cap.names[a]}, computed in stage {t}: pipeline "
                                 "stages pass values to the next stage only (and gradients back to the previous); "
                                 "a model that reuses a value across several layers cannot be cut there")
    for s in range(S):
        act[s].sort(key=order.__getitem__)
    pairs = [_pair(cap, act[s + 1], grad[s], s) for s in range(S - 1)]
    return [_stage_capture(cap, plan, s, stage, src, act, grad, pairs) for s in range(S)]


def _pair(cap: Captured, sent: list[fx.Node], grads: list[fx.Node], s: int) -> list[fx.Node]:
    """Per value stage s sends on, the gradient of it stage s + 1 sends back: matched by shape and dtype, which
    must leave no doubt."""
    out = []
    for v in sent:
        meta = v.meta["val"]
        match = [g for g in grads if tuple(g.meta["val"].shape) == tuple(meta.shape) and g.meta["val"].dtype == meta.dtype]
        if len(match) != 1 or len(sent) != len(grads):
            raise ValueError(f"the boundary after stage {s} passes {len(sent)} value(s) "
                             f"({', '.join(cap.names[x] for x in sent)}) and {len(grads)} gradient(s) back; autopar "
                             "cuts a pipeline where each value sent has one gradient of its own shape (a residual "
                             "stream between layers)")
        out.append(match[0])
    return out


def _stage_capture(cap: Captured, plan: Plan, s: int, stage: dict, src: set, act, grad, pairs) -> StageCut:
    S = len(act)
    mine = [n for n in cap.gm.graph.nodes if stage.get(n) == s]
    need: set[fx.Node] = set()
    stack = [a for n in mine for a in n.all_input_nodes if a in src]
    while stack:
        a = stack.pop()
        if a not in need:
            need.add(a)
            stack.extend(a.all_input_nodes)
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    names: dict[fx.Node, str] = {}
    extra: dict[str, NodePlan] = {}

    def boundary(node: fx.Node, name: str, producer: fx.Node) -> fx.Node:
        new = g.placeholder(name.replace("/", "_").replace(".", "_"))
        new.meta = {"val": producer.meta["val"]}
        names[new] = name
        extra[name] = NodePlan(op=name.split("/")[0], ins=[], outs=[_layout(plan, cap, producer)])
        env[node] = new
        return new

    keep = [n for n in cap.gm.graph.nodes if n in need or stage.get(n) == s]
    for n in keep:  # placeholders first, in the capture's order
        if n.op == "placeholder":
            env[n] = g.node_copy(n, lambda a: env[a])
            names[env[n]] = cap.names[n]
    stage_inputs = [boundary(v, f"activation/{k}", v) for k, v in enumerate(act[s])]
    # A gradient crosses in the layout of the activation it belongs to (the shape PipelineStage sends back);
    # each side redistributes it to and from where the plan computes it.
    tangents = [boundary(gr, f"tangent/activation.{k}", v) for k, (gr, v) in
                enumerate(zip(pairs[s], act[s + 1]) if s < S - 1 else [])]
    for n in keep:
        if n.op != "placeholder":
            env[n] = g.node_copy(n, lambda a: env[a])
            if n in cap.names:
                names[env[n]] = cap.names[n]
    for new, old in ((env[n], n) for n in keep):
        new.meta = dict(old.meta)
    g.output(None)
    gm = fx.GraphModule(cap.gm, g)
    last = s == S - 1

    def moved(d: dict) -> dict:
        return {k: env[v] for k, v in d.items() if v in env}

    params = moved(cap.params)
    grads = {f: env[gr] for f, gr in cap.grads.items() if f in params and gr is not None and gr in env}
    missing = [f for f in params if f in cap.grads and f not in grads]
    if missing:
        raise ValueError(f"the parameter {missing[0]} is used by stage {s} and its gradient computed in another stage "
                         "(weights tied across stages, such as an embedding shared with the output head); untie "
                         "them or use a mesh without a pipeline axis")
    out = dataclasses.replace(
        cap, gm=gm, names=names, nodes={v: k for k, v in names.items()}, params=params, buffers=moved(cap.buffers),
        inputs=[env[n] for n in cap.inputs if n in env],
        tangents=[env[t] for t in cap.tangents if t in env] if last else tangents,
        loss=env[cap.loss] if last else None, grads=grads,
        phase={env[n]: p for n, p in cap.phase.items() if n in env},
        module_of={env[n]: m for n, m in cap.module_of.items() if n in env},
        block_of={env[n]: b for n, b in cap.block_of.items() if n in env},
        param_specs={f: v for f, v in cap.param_specs.items() if f in params},
        checkpointed={env[n] for n in cap.checkpointed if n in env},
        mutations={f: env[v] for f, v in cap.mutations.items() if v in env},
        outputs=[env[o] for o in cap.outputs] if last else [],
        loss_count=env[cap.loss_count] if last and cap.loss_count is not None else None,
        stage_inputs=stage_inputs, stage_outputs=[] if last else [env[v] for v in act[s + 1]],
        input_grads=[env[gr] for gr in pairs[s - 1]] if s > 0 else [])
    if last and cap.loss not in env:
        raise CodegenError("the loss is not computed by the last stage")
    return StageCut(s, out, dataclasses.replace(plan, nodes={**plan.nodes, **extra}))


def _layout(plan: Plan, cap: Captured, node: fx.Node) -> tuple:
    import operator

    idx = 0
    if node.op == "call_function" and node.target is operator.getitem:
        node, idx = node.args[0], int(node.args[1])
    name = cap.names[node]
    np_ = plan.nodes.get(name) or plan.nodes[plan.key(name)]
    return tuple(np_.outs[idx])


__all__ = ["StageCut", "stage_of", "cut_stages"]
