"""Lower the captured joint graph and a Plan to one rank's LOCAL joint graph: local shards in, a collective
wherever a producer's layout differs from what its consumer was planned to read, local shapes everywhere."""
from __future__ import annotations

import dataclasses
import operator
import re

import torch
import torch.fx as fx
from torch.distributed.tensor import Placement, Replicate

from autopar.capture import Captured
from autopar.codegen.builder import Builder, CodegenError, RankSpec, local_val_shape
from autopar.codegen.collectives import (BUCKET_META, GatherBucket, checked_steps, emit_bucket_issue,
                                        emit_bucket_wait, redistribute)
from autopar.codegen.grad_sync import grad_sync_graph, sync_grads
from autopar.codegen.local_shapes import (OpSite, describe_shapes, expected_local_shapes, local_device_kwargs,
                                          localize)
from autopar.codegen import rng
from autopar.codegen.fp8 import Fp8Lowering
from autopar.layout import fmt_layout, local_shape, transpose_layout
from autopar.plan import NodePlan, Plan
from autopar.recompute import plan_variants, recomputed_nodes

Layout = tuple[Placement, ...]
GRAD_SYNC = "autopar_grad_sync"


@dataclasses.dataclass
class LocalJoint:
    """One rank's joint forward+backward graph over local shards.

    Placeholders: params (in `params` order), buffers, inputs, tangents, and `rng_seed` (an int, the step
    seed of codegen/rng.py) when the program draws dropout masks. Output: (loss replicated, grad per param in
    `params` order, each in its parameter's layout, or None, then the new value of each buffer in `updates`,
    in the buffer's layout, then the other outputs in their producers' layouts)."""

    gm: fx.GraphModule
    phase: dict[fx.Node, str]
    params: dict[str, fx.Node]
    buffers: dict[str, fx.Node]
    inputs: list[fx.Node]
    tangents: list[fx.Node]
    layouts: dict[str, Layout]  # placeholder node name -> layout of its local value
    rng_seed: fx.Node | None = None
    # Forward nodes the plan recomputes and those of the model's activation-checkpointed regions (and the
    # collectives feeding them, autopar/recompute.py): recomputed in backward instead of saved.
    recompute: set[fx.Node] = dataclasses.field(default_factory=set)
    updates: list[str] = dataclasses.field(default_factory=list)  # buffers the step updates, in output order
    n_outputs: int = 0  # outputs besides the loss (returned in their producers' layouts), last in the output
    # Several microbatches (plan.microbatches > 1): the gradients leave in the layouts they are produced in, to
    # be accumulated over the microbatches, and `grad_sync` takes the accumulated ones (of the parameters in
    # `synced`, in that order) to their parameters' layouts, once per step. `count`: the output ends with the
    # loss's count, replicated (loss_reduction "count"), which weighs the microbatches.
    grad_sync: fx.GraphModule | None = None
    synced: list[str] = dataclasses.field(default_factory=list)
    count: bool = False
    # A pipeline stage: the activations it receives (placeholders after the inputs); the output starts with
    # the n_heads activations it sends (instead of the loss), and the grads are followed by n_input_grads
    # gradients of its received activations.
    stage_inputs: list[fx.Node] = dataclasses.field(default_factory=list)
    n_heads: int = 1
    n_input_grads: int = 0

    @property
    def code(self) -> str:
        return self.gm.code


def _out_of(node: fx.Node) -> tuple[fx.Node, int]:
    if node.op == "call_function" and node.target is operator.getitem:
        return node.args[0], int(node.args[1])
    return node, 0


class _Lowering:
    def __init__(self, plan: Plan, cap: Captured, rank: RankSpec):
        if tuple(plan.mesh.shape) != tuple(rank.axis_sizes) or tuple(plan.mesh.axis_names) != tuple(rank.axis_names):
            raise ValueError(f"the plan is for mesh {dict(zip(plan.mesh.axis_names, plan.mesh.shape))}, the rank "
                             f"belongs to mesh {dict(zip(rank.axis_names, rank.axis_sizes))}")
        self.plan, self.cap, self.rank = plan, cap, rank
        self.b = Builder()
        self.env: dict[fx.Node, fx.Node] = {}
        self.cache: dict[tuple, fx.Node] = {}
        self.emitted: dict[tuple, list[fx.Node]] = {}  # the nodes each cached redistribution emitted
        self.buckets: list[GatherBucket] = []
        self.bucket_of: dict[tuple, int] = {}  # (param, layout) -> index into buckets
        self.gathered: dict[tuple, fx.Node] = {}  # (param, layout) -> the param's local value in that layout
        self.param_cache: dict[tuple, fx.Node] = {}  # (local value, layout) -> it redistributed
        self.fp8 = Fp8Lowering(self)
        self.deferred: list[str] = []  # parameters whose gradient reductions grad_sync runs (microbatches)

    # --- plan lookups ----------------------------------------------------------------------------------
    def node_plan(self, node: fx.Node) -> NodePlan:
        name = self.cap.names[node]
        np_ = self.plan.nodes.get(name) or self.plan.nodes.get(self.plan.key(name))
        if np_ is None:
            raise CodegenError(f"the plan has no entry for node {name} ({node.target}); the plan was made for "
                               "another graph")
        return np_

    def layout_of(self, node: fx.Node) -> Layout:
        u, idx = _out_of(node)
        outs = self.node_plan(u).outs
        if idx >= len(outs):
            raise CodegenError(f"the plan gives {len(outs)} output layouts for {self.cap.names[u]}, "
                               f"output {idx} is read")
        return tuple(outs[idx])

    # --- building ----------------------------------------------------------------------------------------
    def run(self) -> LocalJoint:
        cap = self.cap
        params, buffers, inputs, tangents, layouts, stage_inputs = {}, {}, [], [], {}, []
        kinds = {n: ("param", f) for f, n in cap.params.items()}
        kinds.update({n: ("buffer", f) for f, n in cap.buffers.items()})
        nodes = list(cap.gm.graph.nodes)
        for node in nodes:
            if node.op != "placeholder":
                continue
            new = self._placeholder(node)
            layouts[new.name] = self.layout_of(node)
            kind, what = kinds.get(node, (None, None))
            if kind == "param":
                params[what] = new
            elif kind == "buffer":
                buffers[what] = new
            elif node in cap.tangents:
                tangents.append(new)
            elif node in cap.stage_inputs:
                stage_inputs.append(new)
            else:
                inputs.append(new)
        self.rng_seed = None
        if any(_random_dropout(n) for n in nodes):
            self.rng_seed = self.b.graph.placeholder(rng.SEED_INPUT)
            self.rng_seed.meta["val"] = 0
        self._plan_gather_buckets(nodes)
        # The plan's recomputed layers and the model's own checkpointed regions (autopar/recompute.py).
        recomputed = recomputed_nodes(cap, plan_variants(self.plan))
        for node in nodes:
            if node.op == "call_function":
                if node not in self.env:  # a parameter cast may have been emitted early, for its bucket
                    self.b.in_checkpoint = node in recomputed
                    self.env[node] = self._call(node)
                    self.b.in_checkpoint = False
            elif node.op == "get_attr":
                self.env[node] = self.b.constant(node.target, getattr(cap.gm, node.target))
            elif node.op == "output":
                self._output()
        gm = self.b.module()
        params = {f: params[f] for f in cap.params}
        joint = LocalJoint(gm, self.b.phase, params, buffers, inputs, tangents, layouts, self.rng_seed,
                           self.b.recompute, list(cap.mutations), len(cap.outputs), stage_inputs=stage_inputs,
                           n_heads=len(cap.stage_outputs) or 1, n_input_grads=len(cap.input_grads))
        if self.deferred:
            joint.synced = list(self.deferred)
            joint.grad_sync = self._grad_sync_graph()
            joint.count = cap.loss_reduction == "count" and not cap.stage_outputs
        return joint

    def _placeholder(self, node: fx.Node) -> fx.Node:
        name = re.sub(r"[^0-9a-zA-Z_]", "_", self.cap.names[node].split("/", 1)[1]).strip("_")
        prefix = self.cap.names[node].split("/", 1)[0]
        name = f"{prefix}_{name}" if prefix in ("input", "tangent") else name
        if not name.isidentifier():  # "0.weight" of an nn.Sequential
            name = f"{prefix}_{name}"
        val = node.meta["val"]
        shape = local_shape(tuple(val.shape), self.layout_of(node), self.rank.axis_sizes)
        new = self.b.placeholder(name, shape, val.dtype)
        self.env[node] = new
        return new

    def _arg(self, a: fx.Node, dst: Layout | None, phase: str, consumer: str) -> fx.Node:
        new = self.env[a]
        if dst is None or self.layout_of(a) == tuple(dst):
            return new
        dst = tuple(dst)
        base = self._param_view(a)
        if base is None:
            return self._redistribute(new, self.layout_of(a), dst, phase,
                                      f"the input {self.cap.names.get(a, a.name)} of {consumer}")
        # A parameter (or its cast), or a transpose of one: redistribute the parameter itself (gathered on its
        # own dim, in its block's bucket) and transpose the result. Parameter-only values are recomputed in
        # backward rather than saved, so one gathered copy serves forward and backward uses alike.
        key = (new, dst)
        if key not in self.param_cache:
            p, odd = base
            pdst = transpose_layout(dst) if odd else dst
            if (p, pdst) not in self.gathered:
                if (p, pdst) in self.bucket_of:
                    self._gather_bucket(self.bucket_of[(p, pdst)])
                else:
                    self.gathered[(p, pdst)] = self._redistribute(self._value(p), self.layout_of(p), pdst, phase,
                                                                  f"the parameter {self.cap.names[p]}")
            v = self.gathered[(p, pdst)]
            self.param_cache[key] = self.b.call(torch.ops.aten.t.default, (v,), phase=phase) if odd else v
        return self.param_cache[key]

    # --- parameter gathers in buckets ------------------------------------------------------------------
    def _param_view(self, a: fx.Node) -> tuple[fx.Node, bool] | None:
        """(base, odd) when `a` is a parameter, a dtype cast of one made in its own layout (mixed precision),
        or a chain of 2-D transposes of either (odd: an odd number of them), each reading its input as laid
        out; `base` is the parameter or the cast."""
        odd = False
        while not self._param_base(a):
            if a.op != "call_function" or a.target is not torch.ops.aten.t.default or a.meta["val"].dim() != 2:
                return None
            inner = a.args[0]
            lay = self.layout_of(inner)
            if tuple(self.node_plan(a).ins[0] or ()) != lay or self.layout_of(a) != transpose_layout(lay):
                return None
            a, odd = inner, not odd
        return a, odd

    def _param_base(self, a: fx.Node) -> bool:
        if a in self.cap.params.values():
            return True
        if a.op != "call_function" or a.target is not torch.ops.aten._to_copy.default or len(a.args) != 1:
            return False
        p = a.args[0]
        return (p in self.cap.params.values() and set(a.kwargs) <= {"dtype"}
                and tuple(self.node_plan(a).ins[0] or ()) == self.layout_of(p) == self.layout_of(a))

    def _param_of(self, base: fx.Node) -> fx.Node:
        return base if base in self.cap.params.values() else base.args[0]

    def _value(self, base: fx.Node) -> fx.Node:
        """The local value of a parameter or of its cast, lowering the cast now if the program has not yet
        (a bucket gathers it before the op that first reads it)."""
        if base not in self.env:
            self.env[base] = self._call(base)
        return self.env[base]

    def _plan_gather_buckets(self, nodes: list[fx.Node]) -> None:
        """Group the parameter all-gathers the program will need, in order of first use, into one collective
        per layer, mesh axis and dtype, as FSDP does per wrapped module (under mixed precision a layer's norm
        weights stay fp32 and gather in a bucket of their own). Parameters outside the model's layers
        bucket only with the ones used right after them, so a head's weight is not gathered at the start."""
        seen: set[tuple] = set()
        runs: list[tuple[tuple, list[tuple], str]] = []  # (block, axis, dtype), members, phase of first use
        for node in nodes:
            if node.op != "call_function" or node.target is operator.getitem:
                continue
            tensor_nodes = [a for a in _flat_nodes((node.args, node.kwargs)) if _is_tensor(a)]
            for slot, (a, dst) in enumerate(zip(tensor_nodes, self.node_plan(node).ins)):
                if dst is None or self.layout_of(a) == tuple(dst):
                    continue
                if self.node_plan(node).variant and self.fp8.gathers_weight(node, slot, a, dst):
                    continue  # gathered in FP8 on its own (codegen/fp8.py)
                base = self._param_view(a)
                if base is None:
                    continue
                p, odd = base
                dst = transpose_layout(tuple(dst)) if odd else tuple(dst)
                steps = checked_steps(self.layout_of(p), dst)
                if (p, dst) in seen or len(steps) != 1 or steps[0].kind != "all_gather":
                    continue
                seen.add((p, dst))
                # A bucket gathers for one phase: a layout only the backward reads is not gathered in the forward.
                group = (self.cap.layer_of(self.cap.names[self._param_of(p)].split("/", 1)[1]), steps[0].axes,
                         p.meta["val"].dtype, self.cap.phase[node])
                run = next((r for r in runs if r[0] == group), None) if group[0] else None
                if run is None and runs and runs[-1][0] == group:
                    run = runs[-1]
                if run is not None:
                    run[1].append(((p, dst), steps[0].dim))
                else:
                    runs.append((group, [((p, dst), steps[0].dim)], self.cap.phase[node]))
        for group, members, phase in runs:
            if len(members) < 2:
                continue
            self.buckets.append(GatherBucket(axes=group[1], phase=phase, members=[(k[0], d) for k, d in members],
                                             keys=[k for k, _ in members]))
            for key, _ in members:
                self.bucket_of[key] = len(self.buckets) - 1

    def _gather_bucket(self, idx: int) -> None:
        """Wait for bucket `idx` (issuing it if needed), cache each member's gathered value, and issue the next
        bucket of the same phase so its collective runs while this block computes."""
        bucket = self.buckets[idx]
        if bucket.done:
            return
        self._issue_bucket(bucket)
        values = emit_bucket_wait(self.b, bucket, [self._value(p) for p, _ in bucket.members], self.rank)
        for key, v in zip(bucket.keys, values):
            self.gathered[key] = v
        bucket.done = True
        if idx + 1 < len(self.buckets) and self.buckets[idx + 1].phase == bucket.phase:
            self._issue_bucket(self.buckets[idx + 1])

    def _issue_bucket(self, bucket: GatherBucket) -> None:
        if bucket.issued is None:
            bucket.issued = emit_bucket_issue(self.b, bucket, [self._value(p) for p, _ in bucket.members], self.rank)
            bucket.issued.meta[BUCKET_META] = tuple(self.cap.names[self._param_of(p)].split("/", 1)[1]
                                                    for p, _ in bucket.members)

    def _redistribute(self, new: fx.Node, src: Layout, dst: Layout, phase: str, what: str) -> fx.Node:
        if src == dst:
            return new
        key = (new, dst, phase)
        if key not in self.cache:
            self.b.log = self.emitted[key] = []
            try:
                self.cache[key] = redistribute(self.b, new, src, dst, self.rank, phase, hint=new.name, what=what)
            except CodegenError as e:
                raise CodegenError(f"redistributing {what} from {fmt_layout(src)} to {fmt_layout(dst)}: {e}") from e
            finally:
                self.b.log = None
        elif self.b.in_checkpoint:
            # Made for a reader the backward does not recompute, and read by one it does: the backward makes it
            # again from the saved value too, rather than saving the copy.
            self.b.recompute.update(self.emitted[key])
        return self.cache[key]

    def _call(self, node: fx.Node) -> fx.Node:
        cap = self.cap
        phase = cap.phase[node]
        if node.target is operator.getitem:
            return self.b.call(operator.getitem, (self.env[node.args[0]], node.args[1]), phase=phase, name=node.name)
        np_ = self.node_plan(node)
        name = cap.names[node]
        tensor_nodes = [a for a in _flat_nodes((node.args, node.kwargs)) if _is_tensor(a)]
        if len(np_.ins) != len(tensor_nodes):
            raise CodegenError(f"the plan gives {len(np_.ins)} input layouts for {name}, which has "
                               f"{len(tensor_nodes)} tensor inputs")
        seen: dict[int, int] = {}

        def sub(a):
            if isinstance(a, fx.Node):
                if not _is_tensor(a):
                    return self.env[a]
                # The same node may appear twice (x * x); each occurrence has its own slot.
                i = _nth_slot(tensor_nodes, a, seen)
                if np_.variant and self.fp8.gathers_weight(node, i, a, np_.ins[i]):
                    return self.fp8.gather_weight(a, np_.ins[i], phase, f"the weight of {name}")
                return self._arg(a, np_.ins[i], phase, name)
            if isinstance(a, (list, tuple)):
                return type(a)(sub(x) for x in a)
            return a

        args = [sub(a) for a in node.args]
        kwargs = {k: sub(v) for k, v in node.kwargs.items()}
        site = _site(node, name, np_, tensor_nodes, self.rank.axis_sizes)
        if np_.variant:  # an FP8 matmul: casts + torch._scaled_mm (codegen/fp8.py)
            new = self.fp8.emit(node, args, phase)
            _check_shapes(site, new)
            return new
        target, args, kwargs = localize(site, args, kwargs)
        fake_kwargs = kwargs
        if self.rank.device != "cpu":
            kwargs = local_device_kwargs(kwargs, self.rank.device)
        if _random_dropout(node):
            target, args, kwargs = self._seeded_dropout(node, np_, args, kwargs)
            fake_kwargs = kwargs
        if target in _VIEWS and not _viewable(args[0].meta["val"], args[1]):
            # A view the global graph could take may not fit a local layout that was re-laid out by a
            # collective; in a functional graph a reshape computes the same value.
            target = torch.ops.aten.reshape.default
        new = self.b.call(target, tuple(args), kwargs, phase=phase, name=node.name, fake_kwargs=fake_kwargs)
        _check_shapes(site, new)
        return new

    def _seeded_dropout(self, node: fx.Node, np_: NodePlan, args: list, kwargs: dict) -> tuple:
        """native_dropout drawing its mask from the generator codegen/rng.py seeds: the same mask on every rank
        holding the same shard of the input, independent ones elsewhere."""
        name = self.cap.names[node]
        if self.cap.phase[node] != "fwd":
            raise CodegenError(f"{name}: a dropout in the backward pass (a forward recomputed by the model) cannot "
                               "reproduce its forward mask; drop the recomputation or use dropout 0")
        x = args[0] if args else kwargs["input"]
        p = float(args[1] if len(args) > 1 else kwargs["p"])
        shard = rng.shard_index(tuple(np_.ins[0]), self.rank.coords, self.rank.axis_sizes)
        return rng.SEEDED_DROPOUT, (x, p, self.rng_seed, rng.stream_key(name), shard), {}

    def _output(self) -> None:
        cap = self.cap
        replicated = tuple(Replicate() for _ in self.rank.axis_sizes)
        # A stage that is not the last sends its activations on, as laid out where they are computed; a graph
        # before a graph break hands its values on replicated.
        if cap.replicated_heads:
            heads = [self._arg(v, replicated, "fwd", "the next graph (after a graph break)")
                     for v in cap.stage_outputs]
        else:
            heads = [self.env[v] for v in cap.stage_outputs] or [self._arg(cap.loss, replicated, "fwd", "the loss")]
        before = set(self.b.graph.nodes)
        local = {fqn: self.env[g] for fqn, g in cap.grads.items() if g is not None}
        if self.plan.microbatches > 1:
            # Accumulated over the microbatches where they are produced; reduced once per step (grad_sync).
            grads = {fqn: local.get(fqn) for fqn in cap.params}
            self.deferred = [fqn for fqn in cap.params if fqn in local]
        else:
            grads = {fqn: None for fqn in cap.params}
            grads.update(self._sync_grads(local))
        for n in self.b.graph.nodes:
            if n not in before:
                n.meta[GRAD_SYNC] = True  # partition issues these as soon as their gradient is ready
        updates = [self._arg(v, self.layout_of(cap.buffers[fqn]), "fwd", f"the new value of buffer {fqn}")
                   for fqn, v in cap.mutations.items()]
        count = []
        if self.plan.microbatches > 1 and cap.loss_reduction == "count" and not cap.stage_outputs:
            count = [self._arg(cap.loss_count, replicated, "fwd", "the loss count")]
        input_grads = [self._arg(g, self.layout_of(a), "bwd", f"the gradient of the received {cap.names[a]}")
                       for g, a in zip(cap.input_grads, cap.stage_inputs)]
        self.b.output((*heads, *(grads[f] for f in cap.params), *input_grads, *updates,
                       *(self.env[o] for o in cap.outputs), *count))

    def _sync_grads(self, local: dict[str, fx.Node]) -> dict[str, fx.Node]:
        return sync_grads(self, local)

    def _grad_sync_graph(self) -> fx.GraphModule:
        return grad_sync_graph(self)


def _random_dropout(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target is torch.ops.aten.native_dropout.default
            and rng.is_random_dropout(node.args, node.kwargs))


_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


def _viewable(t: torch.Tensor, shape) -> bool:
    try:
        t.view(shape)
    except (RuntimeError, ValueError):
        return False
    return True


def _nth_slot(tensor_nodes: list[fx.Node], a: fx.Node, seen: dict[int, int]) -> int:
    k = seen.get(id(a), 0)
    seen[id(a)] = k + 1
    hits = [i for i, t in enumerate(tensor_nodes) if t is a]
    return hits[min(k, len(hits) - 1)]


def _flat_nodes(x) -> list[fx.Node]:
    out: list[fx.Node] = []

    def walk(v):
        if isinstance(v, fx.Node):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            for e in v:
                walk(e)
        elif isinstance(v, dict):
            for e in v.values():
                walk(e)

    walk(x)
    return out


def _is_tensor(a: fx.Node) -> bool:
    return isinstance(a.meta.get("val"), torch.Tensor)


def _site(node: fx.Node, name: str, np_: NodePlan, tensor_nodes: list[fx.Node], sizes) -> OpSite:
    val = node.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else [val]
    out_shapes = [tuple(int(s) for s in v.shape) if isinstance(v, torch.Tensor) else None for v in vals]
    return OpSite(node=node, name=name, in_shapes=[tuple(int(s) for s in a.meta["val"].shape) for a in tensor_nodes],
                  in_layouts=[tuple(x) if x is not None else None for x in np_.ins],
                  out_shapes=out_shapes, out_layouts=[tuple(o) for o in np_.outs], axis_sizes=tuple(sizes))


def _check_shapes(site: OpSite, new: fx.Node) -> None:
    want = expected_local_shapes(site)
    val = new.meta["val"]
    vals = val if isinstance(val, (list, tuple)) else [val]
    got = [tuple(int(s) for s in v.shape) if isinstance(v, torch.Tensor) else None for v in vals]
    if len(want) < len(got):
        want = want + [None] * (len(got) - len(want))
    if any(w is not None and g is not None and w != g for w, g in zip(want, got)):
        outs = " ".join(fmt_layout(o) for o in site.out_layouts)
        raise CodegenError(f"{site.name} ({site.node.target}) computes local shape(s) {describe_shapes(got)} but its "
                           f"planned output layout {outs} of global shape(s) {describe_shapes(site.out_shapes)} "
                           f"needs {describe_shapes(want)}; this op has a shape argument codegen does not localize")


def lower(plan: Plan, cap: Captured, rank: RankSpec) -> LocalJoint:
    """The local joint graph of one rank (see LocalJoint). Tied weights are one graph input already (capture
    merges them and sums their gradients)."""
    return _Lowering(plan, cap, rank).run()


__all__ = ["LocalJoint", "lower", "local_val_shape"]
