"""A Dynamo graph as a model autopar captures: which graph input is which (the module's parameters and buffers,
found by identity among the live modules and named by FQN; the call's tensors; values crossing a graph break),
where its loss is, the nn.Module that runs it with capture's names, and the plan cache's key for it."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import hashlib
import itertools
import json
import re
from typing import Any, Iterator, Sequence

import torch
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh

from autopar import _torch_compat as compat
from autopar.config import Config

BREAK_PREFIX = "autopar_graph_break_input_"  # stand-in parameters: values crossing a graph break
MODULE_KEY = "autopar_module"  # the node annotation capture reads (autopar/_torch_compat.annotate_modules)


@dataclasses.dataclass
class GraphInputs:
    """Which graph input is which: `params` and `buffers` map input positions to FQNs under `root`;
    `input_positions` are the positions of the call's own tensors (the captured model's arguments, in order, whose
    example values are `inputs`); `loss` is the position of the loss among the graph's outputs, which number
    `n_outputs`; the graph takes `n_flat` inputs.

    `forward_only`: traced under no_grad, planned and run without a backward. `heads`: a graph before a graph
    break, which returns values that require grad but no loss: the positions of those outputs among the graph's
    outputs. It is planned like any other graph, captured with `autopar.capture.HEADS`: the values leave it
    replicated, and their gradients, which the later graphs compute, come back into its backward.
    `crossing`: input positions of values a graph before a break computed, which need their gradient: each is
    planned as a replicated stand-in parameter named `BREAK_PREFIX<k>`, whose gradient flows back into the
    earlier graph."""

    root: nn.Module
    params: dict[int, str]
    buffers: dict[int, str]
    input_positions: list[int]
    inputs: tuple
    loss: int
    n_outputs: int
    n_flat: int
    forward_only: bool = False
    heads: list[int] = dataclasses.field(default_factory=list)
    crossing: dict[int, str] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, gm: fx.GraphModule, example: list) -> "GraphInputs":
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        if list(gm.parameters()) or list(gm.buffers()):
            raise ValueError("the graph holds the module's parameters as attributes, not inputs: keep "
                             "torch._dynamo.config.inline_inbuilt_nn_modules = True (the default) with the autopar "
                             "backend")
        for node, value in zip(placeholders, example):
            fake = node.meta.get("example_value", value)
            if compat.has_symbolic_shapes(fake) or compat.has_symbolic_shapes(value):
                raise ValueError("the graph was traced with dynamic shapes; autopar plans static shapes: compile with "
                                 "torch.compile(model, backend=autopar.backend(mesh), dynamic=False), so each new "
                                 "input shape is compiled, and planned, on its own")
        root, names = _root_of([v for v in example if isinstance(v, torch.Tensor)])
        params, buffers, positions, crossing = {}, {}, [], {}
        for i, value in enumerate(example):
            kind_name = names.get(id(value)) if isinstance(value, torch.Tensor) else None
            if kind_name is None:
                if not isinstance(value, torch.Tensor):
                    raise ValueError(f"graph input {i} is a {type(value).__name__}, not a tensor; autopar plans graphs "
                                     "of tensors: compile with dynamic=False")
                if value.requires_grad and torch.is_grad_enabled():
                    crossing[i] = f"{BREAK_PREFIX}{len(crossing)}"
                else:
                    positions.append(i)
            elif kind_name[0] == "param":
                params[i] = kind_name[1]
            else:
                buffers[i] = kind_name[1]
        out = next(n for n in gm.graph.nodes if n.op == "output")
        values = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
        # A graph traced under no_grad (nothing it returns requires grad) runs forward only; its loss is its
        # first scalar.
        forward_only = not any(_value(v) is not None and _value(v).requires_grad for v in values)
        loss = next((k for k, v in enumerate(values) if _is_loss(v, not forward_only)), None)
        if loss is None and not forward_only:
            heads = [k for k, v in enumerate(values) if _value(v) is not None and _value(v).requires_grad]
            return cls(root, params, buffers, positions, tuple(example[i] for i in positions), -1, len(values),
                       len(example), heads=heads, crossing=crossing)
        if loss is None and _input_grads_hook(root, bool(params or buffers) or any(isinstance(v, nn.Parameter)
                                                                                   for v in example)):
            raise ValueError("the compiled graph returns no scalar loss that requires grad: transformers' "
                             "enable_input_require_grads() hook (which gradient_checkpointing_enable() adds) calls "
                             "requires_grad_() on the input embeddings' output, which Dynamo cannot trace, so it ran "
                             "the model's forward eagerly in parts. Call model.disable_input_require_grads() after "
                             "enabling checkpointing: autopar recomputes checkpointed layers without it, and frozen "
                             "input embeddings stay frozen")
        if loss is None:
            raise ValueError("the compiled graph returns no scalar loss that requires grad: the autopar backend "
                             "compiles training steps that end in their loss. Compute the loss inside the compiled "
                             "module (e.g. call it with labels=...) and call it with grad enabled. This graph was "
                             "traced without grad: under torch.no_grad(), or inside a region Dynamo ran eagerly "
                             "(a checkpointed layer with a graph break inside: print, .item(), a data-dependent "
                             "branch, or activation offloading: Dynamo does not trace save_on_cpu, which transformers' "
                             "activation_checkpointing_enable(offload=True) enters; autopar keeps saved activations "
                             "on the device in any case); torch._dynamo.explain(model)(*inputs) lists the graph "
                             "breaks, and "
                             "autopar.parallelize captures the model without Dynamo")
        return cls(root, params, buffers, positions, tuple(example[i] for i in positions), loss, len(values),
                   len(example), forward_only, crossing=crossing)


def _input_grads_hook(root: nn.Module, reads_state: bool) -> bool:
    """Whether a module holding transformers' enable_input_require_grads() hook holds `root` (the graph's, found
    by the state it reads), or `root` it; any live one where the graph reads no module state."""
    mods = {id(m) for m in root.modules()}
    for o in gc.get_objects():
        if issubclass(type(o), nn.Module) and (getattr(o, "_require_grads_hooks", None)
                                               or getattr(o, "_require_grads_hook", None) is not None):
            if not reads_state or id(o) in mods or any(id(m) in mods for m in o.modules()):
                return True
    return False


def _value(node: Any) -> torch.Tensor | None:
    v = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _is_loss(node: Any, requires_grad: bool) -> bool:
    v = _value(node)
    return v is not None and v.ndim == 0 and v.is_floating_point() and (v.requires_grad or not requires_grad)


def _root_of(tensors: list[torch.Tensor]) -> tuple[nn.Module, dict[int, tuple[str, str]]]:
    """The module whose parameters and buffers include every module state among `tensors` (the graph's
    inputs), and id(tensor) -> ("param" | "buffer", FQN under it). Found among the live modules: Dynamo hands
    a backend the tensors, not the module they belong to."""
    ids = {id(t) for t in tensors}
    # type(), not isinstance(): isinstance reads __class__, which some module-like proxies warn about.
    modules = [o for o in gc.get_objects() if issubclass(type(o), nn.Module) and not compat.is_compiled_module(o)]
    owned = {id(t) for m in modules for table in (m._parameters, m._buffers) for t in table.values()
             if t is not None and id(t) in ids}
    if not owned:  # a graph after a break may read none (a loss computed from the earlier graph's outputs)
        return nn.Module(), {}
    children = {id(c) for m in modules for c in m._modules.values() if c is not None}
    best = None
    for m in modules:
        if id(m) in children:
            continue
        names: dict[int, tuple[str, str]] = {}
        for n, p in m.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), ("param", n))
        for n, b in m.named_buffers(remove_duplicate=False):
            names.setdefault(id(b), ("buffer", n))
        if owned <= names.keys() and (best is None or len(names) < len(best[1])):
            best = (m, names)
    if best is None:
        raise ValueError("the compiled graph reads parameters of several separate modules; compile one nn.Module "
                         "that holds every parameter the step uses")
    return best


class GraphStep(nn.Module):
    """Runs a Dynamo graph with the root module's parameters and buffers looked up by FQN (so capture's fake
    state and names apply) and the call's tensors as arguments; returns (loss, *other outputs), or a graph
    before a break its outputs as they are. It shares the
    root's submodules, parameters and buffers: FQNs, tied weights and repeated layers are the root's."""

    def __init__(self, root: nn.Module, gm: fx.GraphModule, graph: GraphInputs, example: Sequence[Any]):
        super().__init__()
        for table in ("_modules", "_buffers", "_non_persistent_buffers_set"):
            self.__dict__[table] = getattr(root, table)
        # The root's own parameters, and a stand-in for each value crossing a graph break (the root is left as is).
        self.__dict__["_parameters"] = dict(root._parameters)
        for i, name in graph.crossing.items():
            x = example[i]
            self._parameters[name] = nn.Parameter(torch.empty(x.shape, dtype=x.dtype, device="meta"))
        self.__dict__["_graph"] = gm
        self.__dict__["_inputs"] = graph

    def forward(self, *inputs: torch.Tensor):
        g = self._inputs
        flat: list[Any] = [None] * g.n_flat
        for i, fqn in {**g.params, **g.buffers, **g.crossing}.items():  # by attribute: the trace substitutes plain tensors
            mod, _, name = fqn.rpartition(".")
            flat[i] = getattr(self.get_submodule(mod) if mod else self, name)
        for i, x in zip(g.input_positions, inputs):
            flat[i] = x
        outs = _Annotated(self._graph).run(*flat)
        outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
        if g.heads:  # in the graph's order (capture with HEADS tells the differentiable ones apart)
            return tuple(outs)
        others = [o for k, o in enumerate(outs) if k != g.loss]
        return (outs[g.loss], *others) if others else outs[g.loss]


class _Annotated(fx.Interpreter):
    """Runs a Dynamo graph node by node, each under the module path Dynamo recorded for it, so the traced ATen
    nodes (and the backward nodes derived from them) carry their module's FQN. A checkpointed region (Dynamo's
    `tag_activation_checkpoint` call: torch.utils.checkpoint, transformers' activation checkpointing) is run
    node by node too, its nodes also tagged with the region's number as `compat.checkpoint_regions` tags them
    under `autopar.parallelize`, so codegen recomputes them in backward rather than saving them (but for the ops
    a selective checkpoint policy saves)."""

    _path: str | None = None

    def __init__(self, gm: fx.GraphModule, region: int | None = None, regions: Iterator[int] | None = None):
        super().__init__(gm)
        self._region, self._regions = region, regions if regions is not None else itertools.count()

    def run_node(self, n: fx.Node) -> Any:
        self._path = compat.dynamo_module_path(n) if n.op in ("call_function", "call_method") else None
        return super().run_node(n)

    def call_method(self, target, args, kwargs) -> Any:
        with self._tags():
            return super().call_method(target, args, kwargs)

    def call_function(self, target, args, kwargs) -> Any:
        region = compat.checkpointed_call(target, args, kwargs)
        if region is not None:
            body, operands, context_fn = region
            with compat.checkpoint_policy(context_fn):  # a selective policy marks the ops it saves
                return _Annotated(body, next(self._regions), self._regions).run(*operands)
        # Annotated here, inside run_node: while tracing with node meta preserved, the interpreter makes a copy of
        # the Dynamo node's meta the current one for the node's duration, which would drop an annotation made
        # around it (every op of the capture would then be the root's, and no layer's).
        with self._tags():
            return super().call_function(target, args, kwargs)

    @contextlib.contextmanager
    def _tags(self) -> Iterator[None]:
        with contextlib.ExitStack() as tags:
            if self._path is not None:
                tags.enter_context(compat.annotate(MODULE_KEY, self._path))
            if self._region is not None:
                tags.enter_context(compat.annotate(compat.CHECKPOINT_KEY, self._region))
            yield


def _policy_key(fn: Any) -> str:
    """A checkpoint context_fn as the plan cache's key holds it: what it is and what it was given (a function by its
    name and code), without the addresses a repr prints, which differ between processes."""
    if fn is None:
        return "-"
    if isinstance(fn, functools.partial):
        return f"{_policy_key(fn.func)}({', '.join(map(_policy_key, fn.args))}; " \
               f"{', '.join(f'{k}={_policy_key(v)}' for k, v in sorted(fn.keywords.items()))})"
    if isinstance(fn, (list, tuple)):
        return f"[{', '.join(map(_policy_key, fn))}]"
    code = getattr(fn, "__code__", None)
    if code is not None:  # its bytecode, the names it reads and its constants (nested code by its own bytecode)
        consts = [c.co_code if hasattr(c, "co_code") else repr(c) for c in code.co_consts]
        body = repr((code.co_code, code.co_names, consts)).encode()
        return f"{fn.__module__}.{fn.__qualname__}:{hashlib.sha256(body).hexdigest()[:16]}"
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(fn))


def graph_key(gm: fx.GraphModule, graph: GraphInputs, mesh: DeviceMesh, config: Config, inner: str,
              shapes: bool = True) -> str:
    """The plan cache's key: the graph's ops and data flow, what each input is (FQN, or the call's k-th tensor)
    with its shape and dtype, the mesh and the config. With `shapes=False`, the shapes are left out: the key of
    the same graph at other input shapes, whose plan may fit these (autopar.plan_check decides)."""
    index: dict[fx.Node, int] = {}
    parts = []

    def shape(v: Any) -> Any:
        return (tuple(v.shape) if isinstance(v, torch.Tensor) else None) if shapes else "-"

    for i, n in enumerate(gm.graph.nodes):
        index[n] = i
        if n.op == "placeholder":
            v = n.meta.get("example_value")
            parts.append(f"in|{i}|{shape(v)}|{getattr(v, 'dtype', None)}")
            continue
        args = fx.node.map_arg((n.args, n.kwargs), lambda a: f"%{index[a]}")
        target = getattr(n.target, "__qualname__", None) or str(n.target)
        parts.append(f"{n.op}|{getattr(n.target, '__module__', '')}.{target}|{args}")
        if n.op == "get_attr" and isinstance(getattr(gm, n.target, None), fx.GraphModule):
            region = getattr(gm, n.target)
            parts.append(region.code)  # a checkpointed region's graph, and its selective policy
            parts.append(_policy_key(compat.checkpointed_call_policy(region)))
    for i, x in enumerate(graph.inputs):
        parts.append(f"input/{i}|{shape(x)}|{x.dtype}")
    parts += [f"crossing/{name}|{pos}" for pos, name in sorted(graph.crossing.items())]  # shapes: placeholders
    root = graph.root
    for pos, fqn in sorted({**graph.params, **graph.buffers}.items()):
        t = root.get_parameter(fqn) if pos in graph.params else root.get_buffer(fqn)
        parts.append(f"{pos}|{fqn}|{shape(t)}|{t.dtype}")
    parts.append(json.dumps([list(mesh.mesh_dim_names), list(mesh.mesh.shape), mesh.device_type,
                             config.to_json(), inner, graph.forward_only, graph.heads], sort_keys=True, default=str))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


__all__ = ["BREAK_PREFIX", "GraphInputs", "GraphStep", "graph_key"]
