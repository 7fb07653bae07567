"""Give every node its plan key, repeat count and role, and list the graph's data edges.

Nodes of identical repeated layers share one key (`layers.*./...`), so the solver decides once per layer
kind. With a template capture (k of L layers traced) counts scale costs back to L layers: nodes inside a
layer count L/k, edges between two layers (L-1)/(k-1). Capture attributes the glue between layers (the
residual stream's gradient accumulation) to one layer, so it counts as inside that layer.
"""
from __future__ import annotations

import collections
import warnings

import torch
import torch.fx as fx

from autopar.passes.context import Edge, PassContext
from autopar.recompute import (VARIANTS, join, model_checkpointed_layers, model_checkpointed_stacks, recomputed_nodes,
                               split)
from autopar.rules.base import flat_tensor_args, op_info


def annotate_shapes_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    cap = ctx.captured
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "call_function", "get_attr") and not isinstance(node.meta.get("val"), (torch.Tensor, list, tuple)):
            raise ValueError(f"node {cap.names.get(node, node.name)} has no recorded tensor value; "
                             "capture must run under fake tensors")
    _assign_keys(gm, ctx)
    _roles(gm, ctx)
    _edges(gm, ctx)
    return gm


def _scale(ctx: PassContext, node: fx.Node) -> tuple[str, float]:
    """('in', L/k) inside a layer, ('out', 1) elsewhere."""
    cap = ctx.captured
    if node in cap.block_of:
        prefix, _ = cap.block_of[node]
        b = next(b for b in cap.blocks if b.prefix == prefix)
        return "in", b.count / b.captured
    name = cap.names.get(node, "")
    if node.op == "placeholder":
        b = cap.stack_of(name.split("/", 1)[-1])
        if b is not None:
            return "in", b.count / b.captured
    return "out", 1.0


def _signature(node: fx.Node) -> tuple:
    if node.op in ("placeholder", "get_attr"):
        return (node.op, tuple(node.meta["val"].shape), node.meta["val"].dtype)
    info = op_info(node) if node.target is not getattr(__import__("operator"), "getitem") else None
    if info is None:
        return ("getitem", node.args[1])
    return (str(node.target), tuple(m.shape for m in info.inputs), tuple(o.shape if o else None for o in info.outputs),
            repr(tuple(a for a in info.args if not hasattr(a, "shape"))))


def _assign_keys(gm: fx.GraphModule, ctx: PassContext) -> None:
    cap = ctx.captured
    groups: dict[str, list[fx.Node]] = collections.defaultdict(list)
    for node in gm.graph.nodes:
        if node.op not in ("placeholder", "call_function", "get_attr"):
            continue
        name = cap.names[node]
        groups[cap.block_relative(name)].append(node)
    for key, nodes in groups.items():
        sigs = {_signature(n) for n in nodes}
        if len(sigs) == 1:
            ctx.members[key] = nodes
        else:  # layers that differ (rare): decide each instance separately
            for n in nodes:
                ctx.members[cap.names[n]] = [n]
    for key, nodes in ctx.members.items():
        total = 0.0
        for n in nodes:
            ctx.key[n] = key
            total += _scale(ctx, n)[1]
        ctx.node_count[key] = total


def _roles(gm: fx.GraphModule, ctx: PassContext) -> None:
    cap = ctx.captured
    params = set(cap.params.values()) | set(cap.buffers.values())
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        ins = node.all_input_nodes
        if ins and all(a in params or a in ctx.param_derived for a in ins):
            ctx.param_derived.add(node)
    recompute_baseline(ctx)  # ctx.recomputed: what backward recomputes before the solver decides more
    ctx.saved = saved_keys(ctx)


# Combinations of recompute variants over several layer stacks the solver tries; stacks beyond stay as fixed
# (no model has come close: one stack is the rule, an encoder-decoder has two).
MAX_COMBINATIONS = 27


def recompute_baseline(ctx: PassContext) -> None:
    """ctx.recompute (stack -> variant, before the solve), ctx.recompute_by (stack -> "model", "config" or
    "solver"), ctx.recompute_offered (stacks the solver decides) and ctx.recomputed."""
    cap = ctx.captured
    mode = ctx.config.recompute
    by_model = model_checkpointed_stacks(cap)
    ctx.recompute, ctx.recompute_by, ctx.recompute_offered = {}, {}, []
    for b in cap.blocks:
        if b.prefix in by_model:
            ctx.recompute[b.prefix], ctx.recompute_by[b.prefix] = by_model[b.prefix], "model"
        elif mode not in ("auto", "off"):  # "selective", "full", "full/r", "full/r/selective"
            ctx.recompute[b.prefix], ctx.recompute_by[b.prefix] = _fixed_variant(mode, b), "config"
        else:
            ctx.recompute[b.prefix], ctx.recompute_by[b.prefix] = "keep", "config" if mode == "off" else "solver"
            if mode == "auto" and len(VARIANTS) ** (len(ctx.recompute_offered) + 1) <= MAX_COMBINATIONS:
                ctx.recompute_offered.append(b.prefix)
    ctx.recompute_fixed = dict(ctx.recompute)
    ctx.recomputed = recomputed_nodes(cap, ctx.recompute)


def _fixed_variant(mode: str, block) -> str:
    """Config.recompute as one stack's variant: "full/r" with r at least the stack's layers is "full"; in a
    planning template (one captured layer standing for several), r rounds down to whole captured layers, with a
    warning."""
    kind, r, others = split(mode)
    if r is None:
        return mode
    per = block.count // block.captured if block.count % block.captured == 0 else block.count
    whole = r // per * per
    if whole >= block.count:
        return kind
    if whole != r:
        warnings.warn(f"Config(recompute={mode!r}): the planning template captures {block.captured} of the "
                      f"{block.count} layers of {block.prefix}, so it recomputes {whole} layers in whole captured "
                      "layers; plan with Config(template_layers=None) (as parallelize does) for exactly r",
                      stacklevel=2)
    return join(kind, whole, others) if whole else others


def saved_keys(ctx: PassContext) -> set[str]:
    """Keys of the forward values backward keeps, given ctx.recomputed."""
    cap = ctx.captured
    out: set[str] = set()
    for node in cap.gm.graph.nodes:
        if node.op == "call_function" and cap.phase[node] == "fwd" and node not in ctx.param_derived:
            if any(u.op == "call_function" and cap.phase[u] == "bwd" for u in node.users):
                for kept in _kept_for(node, ctx.recomputed, ctx):
                    out.add(ctx.key[_view_base(kept, ctx)])
    return out


def _kept_for(node: fx.Node, recomputed: set[fx.Node], ctx: PassContext) -> list[fx.Node]:
    """What backward keeps to use `node`: the node itself, or, inside a checkpointed region, the region's inputs
    that recomputing it reads."""
    if node not in recomputed:
        return [node]
    out, stack, seen = [], [node], set()
    while stack:
        n = stack.pop()
        for a in n.all_input_nodes:
            if a in seen or a.op != "call_function" or a in ctx.param_derived:
                continue
            seen.add(a)
            if a in recomputed:
                stack.append(a)
            else:
                out.append(a)
    return out


def producer(node: fx.Node) -> tuple[fx.Node, int]:
    """The node that computes a value, looking through tuple getitem."""
    import operator

    if node.op == "call_function" and node.target is operator.getitem:
        return node.args[0], int(node.args[1])
    return node, 0


def _edge_scale(ctx: PassContext, u: fx.Node, v: fx.Node) -> float:
    (ku, _), (kv, sv) = _scale(ctx, u), _scale(ctx, v)
    cap = ctx.captured
    if ku == "in" and kv == "in":
        if u.op == "placeholder" or cap.block_of.get(u) == cap.block_of.get(v):
            return sv
        prefix = cap.block_of[u][0]
        b = next(b for b in cap.blocks if b.prefix == prefix)
        return (b.count - 1) / max(b.captured - 1, 1)
    return 1.0


def _edges(gm: fx.GraphModule, ctx: PassContext) -> None:
    import operator

    cap = ctx.captured
    acc: dict[tuple, list] = {}

    def add(u: fx.Node, out: int, v_key: str, arg: int, count: float, kind: str, meta) -> None:
        k = (ctx.key[u], out, v_key, arg, kind)
        if k in acc:
            acc[k][0] += count
        else:
            acc[k] = [count, meta]

    for v in gm.graph.nodes:
        if v.op != "call_function" or v.target is operator.getitem:
            continue
        info = op_info(v)
        for i, a, u, out, kind in tensor_reads(ctx, v):
            count = _edge_scale(ctx, u, v)
            if kind == "param" and cap.phase[v] == "fwd" and v in ctx.param_derived and _feeds_backward(v, ctx):
                # FSDP-style: computed again in backward instead of being kept alive, its layout changes with it
                count *= 2
            add(u, out, ctx.key[v], i, count, kind, info.inputs[i])
    for fqn, g in cap.grads.items():
        u, out = producer(g)
        pnode = cap.params[fqn]
        add(u, out, ctx.key[pnode], -1, _scale(ctx, pnode)[1], "grad", _tensor_meta(pnode))
    for fqn, value in cap.mutations.items():  # a buffer's new value goes to the buffer's own layout
        u, out = producer(value)
        bnode = cap.buffers[fqn]
        add(u, out, ctx.key[bnode], -1, _scale(ctx, bnode)[1], "buffer", _tensor_meta(bnode))
    # The loss ends replicated; so does each value a graph before a graph break hands on (its heads).
    for k, v in enumerate(cap.stage_outputs if cap.replicated_heads else [cap.loss]):
        u, out = producer(v)
        add(u, out, f"<head {k}>" if cap.replicated_heads else "<loss>", -1, 1.0, "loss", _tensor_meta(v))
    ctx.edges = [Edge(src, out, dst, arg, count, kind, meta)
                 for (src, out, dst, arg, kind), (count, meta) in acc.items()]


def tensor_reads(ctx: PassContext, v: fx.Node) -> list[tuple[int, fx.Node, fx.Node, int, str]]:
    """A node's tensor inputs as its edges number them: (input index, the value read, its producer, the producer's
    output, "param" for a parameter, buffer or value computed from parameters alone, else "activation")."""
    cap = ctx.captured
    out = []
    for i, a in enumerate(a for a in flat_tensor_args(v.args, v.kwargs)
                          if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)):
        u, idx = producer(a)
        is_param = u.op == "placeholder" and (u in cap.params.values() or u in cap.buffers.values())
        out.append((i, a, u, idx, "param" if is_param or u in ctx.param_derived else "activation"))
    return out


def _feeds_backward(node: fx.Node, ctx: PassContext) -> bool:
    phase = ctx.captured.phase
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        for u in n.users:
            if u.op != "call_function" or u in seen:
                continue
            seen.add(u)
            if phase[u] == "bwd":
                return True
            if u in ctx.param_derived:
                stack.append(u)
    return False


def _tensor_meta(node: fx.Node):
    from autopar.rules.base import TensorMeta

    v = node.meta["val"]
    return TensorMeta(tuple(int(s) for s in v.shape), v.dtype)


def _view_base(node: fx.Node, ctx: PassContext) -> fx.Node:
    """A saved view keeps its base alive: count the base's memory, once."""
    from autopar.cost.compute import VIEW_OPS

    while (node.op == "call_function" and getattr(node.target, "overloadpacket", None) in VIEW_OPS
           and node.all_input_nodes and node.all_input_nodes[0].op == "call_function"
           and node.all_input_nodes[0] not in ctx.param_derived):
        node = node.all_input_nodes[0]
    return node


def layer_differences(ctx: PassContext) -> list[str]:
    """Where the captured layers of a repeated stack differ: per stack, the layers the model checkpoints where it
    checkpoints some only, else its first op that some captured layer lacks or computes on other shapes (such
    ops are keyed per layer). Empty when every captured layer holds the same ops under the same names and
    checkpointing, so a template of them stands for any number of such layers."""
    cap = ctx.captured
    out = []
    checkpointed = model_checkpointed_layers(cap)
    for b in cap.blocks:
        mine = checkpointed.get(b.prefix, [])
        if 0 < len(mine) < b.captured:  # a template's share of checkpointed layers need not be the model's
            span = f"{b.prefix}.{b.first} to {b.prefix}.{b.first + b.captured - 1}"
            where = ", ".join(f"{b.prefix}.{b.first + i}" for i in mine)
            out.append(f"the model checkpoints {where} only, of {span}")
            continue
        for key, nodes in ctx.members.items():
            if nodes[0].op != "call_function":
                continue
            layers = sorted({cap.block_of[n][1] for n in nodes if cap.block_of.get(n, ("",))[0] == b.prefix})
            if layers and len(layers) < b.captured:
                name = cap.block_relative(cap.names[nodes[0]])
                span = f"{b.prefix}.{b.first} to {b.prefix}.{b.first + b.captured - 1}"
                if name != key:  # keyed per layer
                    out.append(f"{name} ({nodes[0].target}) has other shapes or arguments in some layers of {span}")
                else:
                    where = ", ".join(f"{b.prefix}.{b.first + i}" for i in layers)
                    out.append(f"{name} ({nodes[0].target}) runs in {where} only, of {span}")
                break
    return out
