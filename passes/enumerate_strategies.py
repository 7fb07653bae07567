"""List every legal strategy per plan key: per-axis rules expanded over the mesh, uneven shards dropped,
pins applied."""
from __future__ import annotations

import fnmatch
import itertools
import operator
import warnings

import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar import rules
from autopar.errors import NoStrategyError
from autopar.layout import divides, fmt_layout
from autopar.passes.context import PassContext
from autopar.passes.fp8_variants import add_variants
from autopar.rules.base import op_info
from autopar.strategy import NodeStrategy

R = Replicate()


def enumerate_strategies_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    sizes = ctx.mesh.shape
    pins = _param_pins(ctx)
    ctx.min_inner = ctx.config.solver.min_inner_shard or (1 if ctx.hw.name == "cpu" else 128)
    for key, nodes in ctx.members.items():
        node = nodes[0]
        if node.op == "call_function" and node.target is operator.getitem:
            continue
        if node.op == "get_attr":
            strats = [NodeStrategy((), (tuple(R for _ in sizes),))]
        elif node.op == "placeholder":
            strats = _placeholder_strategies(ctx, node, key, pins)
        else:
            strats = _op_strategies(ctx, node, sizes)
        strats = _apply_act_pins(ctx, key, strats, node)
        if ctx.pipeline_axis is not None:  # the pipeline axis splits the model into stages, never a tensor
            strats = [s for s in strats if all(isinstance(lay[ctx.pipeline_axis], Replicate)
                                               for lay in (*s.ins, *s.outs) if lay is not None)]
        if not strats:
            raise NoStrategyError(f"no legal placement for {key} ({node.target}) on mesh "
                                  f"{dict(zip(ctx.mesh.axis_names, sizes))}: its shapes do not divide by the "
                                  "mesh axes or the pins conflict; change the mesh shape or the pins")
        ctx.strategies[key] = strats
    add_variants(ctx)  # FP8 copies of eligible matmul strategies (passes/fp8_variants.py)
    if ctx.unknown_ops:
        warnings.warn("autopar has no sharding rule for these ops; they run replicated: "
                      + ", ".join(sorted(ctx.unknown_ops)), stacklevel=2)
    return gm


def _op_strategies(ctx: PassContext, node: fx.Node, sizes) -> list[NodeStrategy]:
    """Every combination of one rule strategy per mesh axis whose shards divide every tensor evenly (and leave
    at least ctx.min_inner elements in a sharded last dim), in the order of itertools.product over the axes.
    The conditions on one axis's strategy alone are checked once per strategy, and a prefix of axes that
    already fails to divide (or leaves too few inner elements) is not extended: more shards only divide more."""
    info = op_info(node)
    axis_strats, known = rules.axis_strategies(info)
    if not known:
        ctx.unknown_ops.add(str(node.target))
    # On an axis of one rank every placement holds the whole value: only the replicated strategy is kept there
    # (a shard or partial would name a collective that moves nothing).
    replicated = [c for c in axis_strats if all(p == R for p in (*c.ins, *c.outs) if p is not None)]
    n_in = len(info.inputs)
    prune_through = ctx.config.solver.prune_partial_inputs and n_in > 1
    allowed = [c for c in axis_strats if _axis_ok(c.ins, prune_through)]
    per_axis = [replicated if k == 1 and replicated else allowed for k in sizes]
    if ctx.pipeline_axis is not None:  # the pipeline axis replicates every value (enumerate_strategies_pass)
        per_axis[ctx.pipeline_axis] = replicated
    shapes = [m.shape for m in info.inputs] + [None if m is None else m.shape for m in info.outputs]
    # Per tensor, the placement each axis's strategy gives it (inputs, then outputs).
    n_out = len(info.outputs)
    places = [[(*c.ins[:n_in], *c.outs[:n_out]) for c in strats] for strats in per_axis]
    inner = ctx.min_inner
    out: list[NodeStrategy] = []
    seen = set()
    chosen: list = []

    def extend(axis: int, cur: list) -> None:
        if axis == len(sizes):
            ins = tuple(tuple(c.ins[i] for c in chosen) for i in range(n_in))
            outs = tuple(tuple(c.outs[j] for c in chosen) for j in range(n_out))
            s = NodeStrategy(ins, outs)
            if s not in seen:
                seen.add(s)
                out.append(s)
            return
        k = sizes[axis]
        for c, pl in zip(per_axis[axis], places[axis]):
            nxt = cur
            ok = True
            for t, p in enumerate(pl):
                if shapes[t] is None or not isinstance(p, Shard):
                    continue
                dims = nxt[t]
                if p.dim >= len(dims) or dims[p.dim] % k:
                    ok = False
                    break
                if nxt is cur:
                    nxt = list(cur)
                dims = nxt[t] = list(dims)
                dims[p.dim] //= k
                # The last dim's local size only shrinks as axes are added.
                if inner > 1 and p.dim == len(dims) - 1 and dims[-1] < inner:
                    ok = False
                    break
            if not ok:
                continue
            chosen.append(c)
            extend(axis + 1, nxt)
            chosen.pop()

    extend(0, [None if sh is None else list(sh) for sh in shapes])
    return out


def _axis_ok(ins, prune_through: bool) -> bool:
    """The conditions on one axis's strategy (its input placements) alone: avg-partials become sum-partials by
    a free local rescale, so one partial kind per input; with `prune_through`, no input is Partial unless one is
    sharded (else the op only forwards a pending reduction: add(P, P), mul(P, R); a contraction with a Partial
    addend, addmm's bias, has a sharded input)."""
    if any(isinstance(p, Partial) and p.reduce_op != "sum" for p in ins):
        return False
    return not (prune_through and any(isinstance(p, Partial) for p in ins)
                and not any(isinstance(p, Shard) for p in ins))


def layouts_for(shape: tuple[int, ...], sizes, allow_nested: bool) -> list[tuple]:
    """Every layout of a tensor: R or S(d) per axis, evenly dividing; nested (same dim on two axes) optional."""
    per_axis = [R] + [Shard(d) for d in range(len(shape)) if shape[d] > 1]
    result = []
    for combo in itertools.product(*[per_axis if k > 1 else [R] for k in sizes]):
        dims = [p.dim for p in combo if isinstance(p, Shard)]
        if not allow_nested and len(dims) != len(set(dims)):
            continue
        if divides(shape, combo, sizes):
            result.append(tuple(combo))
    return result


def _placeholder_strategies(ctx: PassContext, node: fx.Node, key: str, pins) -> list[NodeStrategy]:
    cap = ctx.captured
    shape = tuple(int(s) for s in node.meta["val"].shape)
    name = cap.names[node]
    kind, _, what = name.partition("/")
    if kind == "tangent":
        return [NodeStrategy((), (tuple(R for _ in ctx.mesh.shape),))]
    if kind == "input":
        fixed = (ctx.config.input_placements or {}).get(int(what))
        if fixed is not None:
            return [NodeStrategy((), (_check_layout(fixed, shape, ctx, f"input {what}"),))]
        # Inputs (token ids, labels) are cheap to slice any way, and a batch dim may span several axes.
        return [NodeStrategy((), (lay,)) for lay in layouts_for(shape, ctx.mesh.shape, allow_nested=True)]
    rel = cap.block_relative(what)
    for pattern, lay in pins.items():
        if fnmatch.fnmatch(what, pattern) or fnmatch.fnmatch(rel, pattern):
            return [NodeStrategy((), (_check_layout(lay, shape, ctx, f"pin {pattern!r} on {what}"),))]
    return [NodeStrategy((), (lay,)) for lay in layouts_for(shape, ctx.mesh.shape, allow_nested=True)]


def _check_layout(lay, shape, ctx: PassContext, what: str) -> tuple:
    lay = tuple(lay)
    if len(lay) != len(ctx.mesh.shape):
        raise ValueError(f"{what}: {len(lay)} placements given, the mesh has {len(ctx.mesh.shape)} axes "
                         f"{ctx.mesh.axis_names}")
    lay = _one_rank_replicated(lay, ctx.mesh.shape)
    if not divides(shape, lay, ctx.mesh.shape):
        raise ValueError(f"{what}: layout {fmt_layout(lay)} does not divide shape {list(shape)} evenly on mesh "
                         f"{dict(zip(ctx.mesh.axis_names, ctx.mesh.shape))}")
    return lay


def _one_rank_replicated(lay: tuple, sizes) -> tuple:
    """`lay` with the placement on every axis of one rank read as Replicate (the same local value)."""
    return tuple(R if k == 1 else p for p, k in zip(lay, sizes))


def _param_pins(ctx: PassContext) -> dict[str, tuple]:
    return {k: v for k, v in (ctx.config.pins or {}).items() if not k.startswith("act:")}


def _apply_act_pins(ctx: PassContext, key: str, strats: list[NodeStrategy], node: fx.Node) -> list[NodeStrategy]:
    """Keep the strategies whose first output has the layout the first matching "act:" pin names. A pin
    written as a glob skips the ops whose output that layout does not divide (a recipe's "every forward matmul
    on the local batch" meets a matmul without a batch dim); a layout that divides but that no strategy
    produces is an error."""
    for pattern, lay in (ctx.config.pins or {}).items():
        if pattern.startswith("act:") and fnmatch.fnmatch(key, pattern[4:]):
            lay = _one_rank_replicated(tuple(lay), ctx.mesh.shape)
            val = node.meta.get("val")
            val = val[0] if isinstance(val, (list, tuple)) and val else val
            shape = tuple(int(d) for d in getattr(val, "shape", ()))
            if any(ch in pattern[4:] for ch in "*?[") and not divides(shape, lay, ctx.mesh.shape):
                continue
            kept = [s for s in strats if s.outs and s.outs[0] == lay]
            if not kept:
                raise ValueError(f"pin {pattern!r}: no legal strategy of {key} outputs {fmt_layout(lay)}; "
                                 f"legal outputs: {sorted({fmt_layout(s.outs[0]) for s in strats})}")
            return kept
    return strats
