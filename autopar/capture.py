"""Capture one joint forward+backward ATen graph of a model and its loss under fake tensors.

The graph's placeholders are parameters, buffers, user inputs and the loss tangent; its outputs are the loss
and one gradient per parameter. Every node gets a stable name (module FQN + phase + op + ordinal) and a
block index when it belongs to a repeated layer (an entry of an nn.ModuleList of identical blocks), so the
planner can share decisions across layers.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import re
import time
import warnings
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch import nn

from autopar import _torch_compat as compat
from autopar.errors import CaptureError

LossFn = Callable[..., torch.Tensor]


class Heads:
    """The `loss_fn` of a graph that ends in values another graph goes on with, not in a loss (a torch.compile
    graph before a graph break): the model returns a tensor or a tuple of tensors; those that require grad
    become the capture's `stage_outputs`, each with its tangent (the gradient the later graph sends back), and
    the others its `outputs`. The capture has no loss."""


HEADS = Heads()


def stack_pattern(prefix: str, first: int = 0) -> str:
    """A regex of `prefix.i` for the layers of a stack whose children before `first` differ from the rest (i >=
    first); group 1 is the index."""
    skip = f"(?!(?:{'|'.join(str(i) for i in range(first))})(?=[./]|$))" if first else ""
    return rf"{re.escape(prefix)}\.{skip}(\d+)"


@dataclasses.dataclass
class Block:
    """A repeated layer stack: `prefix.i` for first <= i < first + count in the model, `captured` of them in the
    graph. The children before `first` (a first layer that also builds what the others share, such as T5's
    relative position bias) are outside the stack."""

    prefix: str
    count: int
    captured: int
    first: int = 0

    @property
    def pattern(self) -> str:
        return stack_pattern(self.prefix, self.first)


@dataclasses.dataclass
class Captured:
    gm: fx.GraphModule
    names: dict[fx.Node, str]
    nodes: dict[str, fx.Node]
    params: dict[str, fx.Node]
    buffers: dict[str, fx.Node]
    inputs: list[fx.Node]
    tangents: list[fx.Node]
    loss: fx.Node | None  # None in a capture of heads (HEADS)
    grads: dict[str, fx.Node]
    phase: dict[fx.Node, str]
    module_of: dict[fx.Node, str]
    block_of: dict[fx.Node, tuple[str, int]]  # (stack prefix, layer index within the stack: 0 is its first)
    blocks: list[Block]
    input_specs: list[tuple[tuple[int, ...], torch.dtype]]
    param_specs: dict[str, tuple[tuple[int, ...], torch.dtype]]
    capture_seconds: float = 0.0
    # Forward nodes the model computes inside activation checkpointing (torch.utils.checkpoint, transformers'
    # gradient_checkpointing_enable): recomputed in backward rather than saved.
    checkpointed: set[fx.Node] = dataclasses.field(default_factory=set)
    # Buffers the step updates in place (batch norm running statistics, counters): FQN -> the new value.
    mutations: dict[str, fx.Node] = dataclasses.field(default_factory=dict)
    # FQNs of the batch norm modules that run in training mode (they compute batch statistics).
    batch_norms: list[str] = dataclasses.field(default_factory=list)
    # Outputs besides the loss, when the loss function returns (loss, *outputs): returned, never differentiated.
    outputs: list[fx.Node] = dataclasses.field(default_factory=list)
    # How the loss adds up over microbatches (autopar.microbatch.REDUCTIONS) and, for "count", the node of the
    # count the loss divides by (computed from the inputs alone).
    loss_reduction: str = "mean"
    loss_count: fx.Node | None = None
    # A pipeline stage's capture (autopar/codegen/stages.py): the activations it receives from the previous
    # stage (placeholders), those it sends to the next (outputs, instead of the loss), and the gradients of its
    # received activations (backward outputs, in stage_inputs order). A capture with `loss_fn=HEADS` (a graph
    # before a graph break) has stage_outputs and their tangents, and no loss.
    stage_inputs: list[fx.Node] = dataclasses.field(default_factory=list)
    stage_outputs: list[fx.Node] = dataclasses.field(default_factory=list)
    input_grads: list[fx.Node] = dataclasses.field(default_factory=list)
    # The stage outputs leave replicated (a graph before a graph break hands full values on), not in their
    # producers' layouts as a pipeline stage sends them.
    replicated_heads: bool = False

    def name(self, node: fx.Node) -> str:
        return self.names[node]

    def block_relative(self, name: str) -> str:
        for b in self.blocks:
            name = re.sub(rf"(^|[/.]){b.pattern}(?=[./]|$)", rf"\g<1>{b.prefix}.*", name)
        return name

    def layer_of(self, fqn: str) -> str:
        """The repeated layer a parameter or module FQN belongs to ("layers.3"), or "" outside the layers."""
        b = self.stack_of(fqn)
        return "" if b is None else re.match(b.pattern, fqn).group(0)

    def stack_of(self, fqn: str) -> Block | None:
        """The repeated layer stack a parameter or module FQN lies in, or None."""
        return next((b for b in self.blocks if re.match(rf"^{b.pattern}\.", fqn)), None)

    def compute_nodes(self) -> list[fx.Node]:
        return [n for n in self.gm.graph.nodes if n.op == "call_function"]


class _LossWrapper(nn.Module):
    def __init__(self, model: nn.Module, loss_fn: LossFn | None):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *args, **kwargs):
        out = self.model(*args, **kwargs)
        res = self.loss_fn(out, *args, **kwargs) if self.loss_fn is not None else _loss_from_output(out)
        if isinstance(res, (tuple, list)):  # (loss, *other outputs): the others are returned, not differentiated
            return (res[0], *(x.detach() for x in res[1:]))
        return res


class _HeadsWrapper(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *args, **kwargs):
        out = self.model(*args, **kwargs)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _loss_from_output(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor) and out.ndim == 0:
        return out
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    if isinstance(loss, torch.Tensor) and loss.ndim == 0:
        return loss
    raise ValueError("the model does not return a scalar loss: pass loss_fn=(output, *inputs, **kwargs) -> scalar, "
                     "or give the model labels so it returns .loss")


def find_blocks(model: nn.Module) -> list[tuple[str, nn.ModuleList, int]]:
    """ModuleLists ending in at least two structurally identical children (transformer layers): (name, list,
    index of the first of them). Children before those (T5's first layer, which holds the relative position
    bias the others reuse) stay outside the stack."""
    found = []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) >= 2:
            sigs = [_structure(c) for c in mod]
            first = len(sigs) - 1
            while first > 0 and sigs[first - 1] == sigs[-1]:
                first -= 1
            if len(mod) - first >= 2:
                found.append((name, mod, first))
    return found


def _structure(mod: nn.Module) -> tuple:
    return (type(mod).__name__,
            tuple((n, tuple(p.shape), p.dtype) for n, p in mod.named_parameters()),
            tuple((n, type(m).__name__) for n, m in mod.named_modules()))


@contextlib.contextmanager
def _fake_state(model: nn.Module, mode) -> Any:
    """Swap every parameter and buffer for a fake CPU tensor of the same shape; restore on exit."""
    saved = []
    seen: dict[int, Any] = {}
    with mode:
        for mod in model.modules():
            for kind in ("_parameters", "_buffers"):
                table = getattr(mod, kind)
                for key, t in list(table.items()):
                    if t is None:
                        continue
                    saved.append((table, key, t))
                    if id(t) not in seen:
                        fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
                        if kind == "_parameters":
                            fake = nn.Parameter(fake, requires_grad=t.requires_grad)
                        seen[id(t)] = fake
                    table[key] = seen[id(t)]
    try:
        yield
    finally:
        for table, key, t in saved:
            table[key] = t


@contextlib.contextmanager
def _truncated(model: nn.Module, keep: int | None):
    blocks = find_blocks(model)
    saved = []
    if keep is not None:
        for _, ml, first in blocks:
            if len(ml) > first + keep:
                saved.append((ml, dict(ml._modules)))
                ml._modules = {str(i): ml._modules[str(i)] for i in range(first + keep)}
    try:
        yield blocks
    finally:
        for ml, mods in saved:
            ml._modules = mods


def _to_fake_input(x: Any, mode) -> Any:
    if isinstance(x, torch.Tensor):
        with mode:
            return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="cpu")
    return x


def _decompositions(batch_norm_sums: bool = False) -> dict:
    from torch._decomp import get_decompositions

    # Loss reductions become sum / count so a sharded batch reduces exactly (uneven ignore_index too).
    aten = torch.ops.aten
    out = get_decompositions([aten.nll_loss_forward, aten.nll_loss_backward, aten.nll_loss2d_forward,
                              aten.nll_loss2d_backward, aten.mse_loss, aten.mse_loss_backward])
    if batch_norm_sums:  # training batch norm as per-channel sums: a batch-sharded input uses global statistics
        from autopar.rules.sync_batch_norm import DECOMPOSITIONS

        out.update(DECOMPOSITIONS)
    return out


def capture(model: nn.Module, example_inputs: Sequence[Any], example_kwargs: dict | None = None,
            loss_fn: LossFn | None = None, *, template_layers: int | None = None,
            autocast_dtype: torch.dtype | None = None, batch_norm_sums: bool = False,
            read_state_only: bool = False) -> Captured:
    """Trace model+loss into a joint graph. With `template_layers=k`, repeated layer stacks are cut to k
    layers during the trace (the planner scales their costs back up), so capture time does not grow with depth.

    With `autocast_dtype` (bf16 mixed precision) the trace runs under autocast, so the graph holds its casts:
    fp32 parameters cast to bf16 before matmuls, autocast's fp32 ops (losses) in fp32, fp32 gradients. The
    policy is autocast's CPU op lists whatever the target device, since the trace runs on CPU fake tensors
    (CUDA autocast cannot be traced without a GPU) and one policy makes a plan's graph the same on every host.
    Without it, autocast is off during the trace even inside a caller's autocast region, so the graph is the
    precision planned. With `batch_norm_sums`, training batch norm is traced as per-channel sums
    (autopar/rules/sync_batch_norm.py), which a batch-sharded layout reduces across ranks: global statistics, as
    SyncBatchNorm computes them. With `read_state_only`, parameters and buffers the step does not read are left out
    of the capture (a torch.compile graph covers part of the model: it places only what it reads)."""
    t0 = time.perf_counter()
    kwargs = dict(example_kwargs or {})
    mode = compat.fake_tensor_mode()
    heads = isinstance(loss_fn, Heads)
    wrapper = _HeadsWrapper(model) if heads else _LossWrapper(model, loss_fn)
    with _truncated(model, template_layers) as blocks, _fake_state(model, mode):
        args = tuple(_to_fake_input(a, mode) for a in example_inputs)
        kw = {k: _to_fake_input(v, mode) for k, v in kwargs.items()}
        try:
            with contextlib.ExitStack() as stack, mode, compat.annotate_modules(model), compat.compiling(), \
                    compat.checkpoint_regions(), compat.saved_tensor_hooks_entered() as hooks, \
                    torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
                joint = compat.export_joint(stack, wrapper, args, kw, decompositions=_decompositions(batch_norm_sums))
                gm = joint.graph_module
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - report where in the user's model tracing failed
            raise CaptureError.from_exception(e) from e
    if hooks:
        warnings.warn(f"the model enters saved-tensor hooks ({', '.join(sorted(set(hooks)))}; transformers' "
                      "activation_checkpointing_enable(offload=True) enters save_on_cpu): autopar's generated step "
                      "saves the tensors its backward reads itself and does not run them, so saved activations stay "
                      "on the device, where the plan counts them; to save device memory, let the planner recompute "
                      "(Config(recompute='auto'), the default) or checkpoint without offload", stacklevel=3)
    block_list = [Block(name, count=len(ml) - first, captured=min(len(ml) - first, template_layers or len(ml)),
                        first=first) for name, ml, first in blocks]
    _merge_tied(gm, _tie_groups(model))
    _dedupe_casts(gm)
    if read_state_only:
        _drop_unread_state(gm)
    cap = _describe(gm, block_list, heads)
    cap.input_specs = [(tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else None for a in example_inputs]
    cap.batch_norms = [n for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
                       and m.training and n in set(cap.module_of.values())]
    cap.capture_seconds = time.perf_counter() - t0
    return cap


def _drop_unread_state(gm: fx.GraphModule) -> None:
    """Remove the placeholders of parameters and buffers no op reads (their gradients are None)."""
    for node in list(gm.graph.nodes):
        if node.op == "placeholder" and not node.users and \
                compat.descriptor_kind(node.meta.get("desc"))[0] in ("param", "buffer"):
            gm.graph.erase_node(node)
    gm.recompile()


def _dedupe_casts(gm: fx.GraphModule) -> None:
    """One cast per value and dtype. Autocast casts an activation again for every matmul reading it (the
    normed hidden state once each for wq, wk and wv); each copy would be computed and kept for backward."""
    first: dict[tuple, fx.Node] = {}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten._to_copy.default:
            continue
        key = (node.args, tuple(sorted(node.kwargs.items(), key=lambda kv: kv[0])))
        if key in first:
            node.replace_all_uses_with(first[key])
            gm.graph.erase_node(node)
        else:
            first[key] = node
    gm.recompile()


def _tie_groups(model: nn.Module) -> list[list[str]]:
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return [g for g in groups.values() if len(g) > 1]


def _merge_tied(gm: fx.GraphModule, groups: list[list[str]]) -> None:
    """Tied weights (one tensor under several names) become one parameter input with one summed gradient."""
    if not groups:
        return
    placeholders = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            kind, what = compat.descriptor_kind(node.meta.get("desc"))
            if kind == "param":
                placeholders[_strip(what)] = node
    out = next(n for n in gm.graph.nodes if n.op == "output")
    values, descs = list(out.args[0]), list(out.meta.get("desc", []))
    grad_pos = {}
    for i, desc in enumerate(descs):
        kind, what = compat.descriptor_kind(desc)
        if kind == "grad_param":
            grad_pos[_strip(what)] = i
    drop = set()
    for group in groups:
        present = [n for n in group if n in placeholders]
        keep, others = present[0] if present else None, present[1:]
        for other in others:
            placeholders[other].replace_all_uses_with(placeholders[keep])
            # A frozen tied weight (requires_grad=False under every name) has no gradient output at all.
            if other in grad_pos:
                gk, go = values[grad_pos[keep]], values[grad_pos[other]]
                if go is not None:
                    if gk is None:
                        values[grad_pos[keep]] = go
                    else:
                        with gm.graph.inserting_before(out):
                            total = gm.graph.call_function(torch.ops.aten.add.Tensor, (gk, go))
                        total.meta.update(gk.meta)
                        values[grad_pos[keep]] = total
                drop.add(grad_pos[other])
            gm.graph.erase_node(placeholders[other])
    out.args = (tuple(v for i, v in enumerate(values) if i not in drop),)
    out.meta["desc"] = [d for i, d in enumerate(descs) if i not in drop]
    gm.graph.eliminate_dead_code()
    # The traced pytree calling convention counted the dropped inputs; the graph now takes flat arguments.
    gm.graph.set_codegen(fx.graph.CodeGen())
    gm.recompile()


def _strip(fqn: str) -> str:
    return fqn[len("model."):] if fqn.startswith("model.") else fqn


def _describe(gm: fx.GraphModule, blocks: list[Block], heads: bool = False) -> Captured:
    params, buffers, inputs, tangents, grads = {}, {}, [], [], {}
    tangent_of: dict[int, fx.Node] = {}  # output index -> its tangent placeholder
    param_specs = {}
    loss = None
    names: dict[fx.Node, str] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            kind, what = compat.descriptor_kind(node.meta.get("desc"))
            if kind == "param":
                params[_strip(what)] = node
                names[node] = f"param/{_strip(what)}"
                param_specs[_strip(what)] = (tuple(node.meta["val"].shape), node.meta["val"].dtype)
            elif kind == "buffer":
                buffers[_strip(what)] = node
                names[node] = f"buffer/{_strip(what)}"
            elif kind == "input":
                inputs.append(node)
                names[node] = f"input/{len(inputs) - 1}"
            elif kind == "tangent":
                tangents.append(node)
                out_kind, out_idx = compat.descriptor_kind(what)
                if out_kind == "loss":
                    tangent_of[out_idx] = node
                names[node] = f"tangent/{len(tangents) - 1}"
            else:
                raise CaptureError(f"unsupported graph input {node.meta.get('desc')!r}")
    out = next(n for n in gm.graph.nodes if n.op == "output")
    mutations, outputs, heads_out = {}, [], []
    for value, desc in zip(out.args[0], out.meta.get("desc", [])):
        kind, what = compat.descriptor_kind(desc)
        if kind == "loss" and heads:
            (heads_out if what in tangent_of else outputs).append(value)
        elif kind == "loss" and loss is None:
            loss = value
        elif kind == "loss":
            outputs.append(value)
        elif kind == "grad_param" and value is not None:
            grads[_strip(what)] = value
        elif kind == "mutated_buffer":
            mutations[_strip(what)] = value
        elif kind == "mutated_input":
            raise CaptureError(f"the model changes its input {what} in place (an in-place op such as `x.add_()` "
                               "or `x[...] = ...` on an argument of forward); autopar cannot carry that to the "
                               "caller's tensor: compute on a copy (`x = x.clone()`) or out of place")
        elif kind == "mutated_param":
            raise CaptureError(f"the model changes the parameter {_strip(what)} in place during the step; only the "
                               "optimizer may update parameters under autopar: make the update out of place, or "
                               "keep the value in a buffer (register_buffer)")
    if heads:  # tangents in the order of the values they belong to
        if not heads_out:
            raise CaptureError("the traced graph returns no value that requires grad")
        tangents = [tangent_of[i] for i in sorted(tangent_of)]
        for k, t in enumerate(tangents):
            names[t] = f"tangent/{k}"
    elif loss is None:
        raise CaptureError("the traced graph has no loss output")
    module_of, phase = _attribute(gm, [b.prefix for b in blocks])
    counts: collections.Counter = collections.Counter()
    for node in gm.graph.nodes:
        if node.op == "get_attr":  # constants the model creates (masks, scalars): always replicated
            base = "const/" + (next((module_of[u] for u in node.users if u in module_of), "") or "root")
            names[node] = f"{base}/{counts[base]}"
            counts[base] += 1
            continue
        if node.op != "call_function":
            continue
        op = node.target.__name__ if callable(node.target) else str(node.target)
        op = op.split(".")[0] if op != "getitem" else "getitem"
        base = f"{module_of[node] or 'root'}/{phase[node]}/{op}"
        k = counts[base]
        counts[base] += 1
        names[node] = base if k == 0 else f"{base}#{k}"
    block_of = {}
    for node, mod in module_of.items():
        for b in blocks:
            m = re.match(rf"^{b.pattern}(\.|$)", mod or "")
            if m:
                block_of[node] = (b.prefix, int(m.group(1)) - b.first)
    checkpointed = {n for n, ph in phase.items() if ph == "fwd" and compat.checkpoint_region(n) is not None}
    cap = Captured(gm=gm, names=names, nodes={v: k for k, v in names.items()}, params=params, buffers=buffers,
                   inputs=inputs, tangents=tangents, loss=loss, grads=grads, phase=phase, module_of=module_of,
                   block_of=block_of, blocks=blocks, input_specs=[], param_specs=param_specs,
                   checkpointed=checkpointed, mutations=mutations, outputs=outputs, stage_outputs=heads_out,
                   replicated_heads=heads)
    if not heads:
        from autopar.microbatch import loss_reduction

        cap.loss_reduction, cap.loss_count = loss_reduction(cap)
    return cap


def _attribute(gm: fx.GraphModule, prefixes: list[str]) -> tuple[dict[fx.Node, str], dict[fx.Node, str]]:
    """Module FQN and phase per compute node.

    A node outside every repeated layer (unannotated gradient accumulation, or code of the layer stack itself)
    that reads values of a layer belongs to the layer of its latest such input, under the longest common
    prefix of its inputs in that layer: the residual-stream glue between layers i+1 and i is part of one
    layer, numbered alike in every layer, so a template's names cover any depth. Other unannotated nodes take
    the longest common module prefix of their inputs."""
    module_of: dict[fx.Node, str] = {}
    phase: dict[fx.Node, str] = {}
    position: dict[fx.Node, int] = {}
    for i, node in enumerate(gm.graph.nodes):
        position[node] = i
        if node.op != "call_function":
            continue
        tag = node.meta.get("partitioner_tag")
        phase[node] = "bwd" if tag == "is_backward" or node.meta.get("autograd_backward") else "fwd"
        mod = compat.node_module(node)
        if mod is None or mod in prefixes:
            ins = sorted((a for a in node.all_input_nodes if module_of.get(a)), key=position.__getitem__)
            layers = [_layer(module_of[a], prefixes) for a in ins]
            latest = next((layer for layer in reversed(layers) if layer), None)
            if latest is not None:
                mod = _common_prefix([module_of[a] for a, layer in zip(ins, layers) if layer == latest])
            elif mod is None:
                mod = _common_prefix([module_of[a] for a in ins]) if ins else ""
        module_of[node] = mod
    return module_of, phase


def _layer(mod: str, prefixes: list[str]) -> str | None:
    """`prefix.i` when module `mod` lies in layer i of a repeated stack, else None."""
    for prefix in prefixes:
        m = re.match(rf"{re.escape(prefix)}\.\d+(?=\.|$)", mod)
        if m:
            return m.group(0)
    return None


def _common_prefix(mods: list[str]) -> str:
    parts = [m.split(".") for m in mods]
    out = []
    for seg in zip(*parts):
        if len(set(seg)) != 1:
            break
        out.append(seg[0])
    return ".".join(out)
