"""The torch.compile backend: each graph Dynamo hands over is captured (joint forward and backward), planned
and generated through the one driver, the module's parameters become DTensors in the plan's layouts, and the
rank's Program runs as the graph's compiled form.

    cm = torch.compile(model, backend=autopar.backend(mesh))
    out = cm(tokens, labels=tokens)       # first call: plan, shard, compile
    opt = torch.optim.AdamW(model.parameters())

How a Dynamo graph becomes a model autopar can capture: the graph's inputs are the module's parameters and
buffers (Dynamo inlines built-in modules, so they are placeholders whose example values are the tensors
themselves) and the call's tensors. The parameters are found among the live modules by identity, named by
their FQN under the root module that holds them all, and a `_GraphStep` (an nn.Module sharing the root's
submodules, parameters and buffers, so FQNs, tied weights and repeated layers are the root's) runs the graph
with them; each node runs under the module path Dynamo recorded, so plan keys read `layers.0.attention/fwd/mm`
as under `autopar.parallelize`. The graph must return a scalar loss that requires grad (the step autopar
trains); its other outputs are returned as DTensors in their planned layouts, not differentiated.

The parameters are swapped for DTensors inside the backend call, before Dynamo builds its guards, so the
guards describe the DTensor parameters and later calls run the compiled program without a recompile. An
optimizer made over the old parameter objects before the first call would step stale tensors; its first
`step()` raises instead (`_StaleOptimizerCheck`), as FSDP2's `fully_shard` asks for the optimizer after sharding.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import json
import os
import time
import weakref
from typing import Any, Sequence

import torch
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from autopar import _torch_compat as compat
from autopar.config import Config
from autopar.plan import Plan

BREAK_PREFIX = "autopar_graph_break_input_"  # stand-in parameters: values crossing a graph break
MODULE_KEY = "autopar_module"  # the node annotation capture reads (autopar/_torch_compat.annotate_modules)
INNER = ("eager", "inductor")
OUTPUTS = ("sharded", "global")


def backend(mesh: DeviceMesh, *, config: Config | None = None, inner: str = "inductor", outputs: str = "sharded",
            seed: int | None = None, cache_dir: str | None = None) -> "Backend":
    """A torch.compile backend that plans, shards and runs a module over `mesh`:
    `torch.compile(model, backend=autopar.backend(mesh))`.

    inner: "inductor" (default) compiles the rank's forward and backward graphs with Inductor (Triton kernels
           on GPU, C++ on CPU); "eager" runs them as fx graphs.
    outputs: "sharded" (default) returns outputs other than the loss as DTensors in their planned layouts (no
             gather of logits every step); "global" gathers each to a full tensor after the step.
    seed: base seed of dropout masks (default: rank 0's torch.initial_seed()).
    cache_dir: also keep plans on disk, one JSON file per graph, mesh and config, so a new process reuses them.
    Every rank compiles the same model with the same inputs; rank 0 plans and sends the plan to the others."""
    return Backend(mesh, config=config, inner=inner, outputs=outputs, seed=seed, cache_dir=cache_dir)


class Backend:
    """Compiles Dynamo graphs (see the module docstring). `stats` counts compiles, plans made and plans reused
    from the cache (keyed by graph, input shapes, mesh and config)."""

    def __init__(self, mesh: DeviceMesh, *, config: Config | None, inner: str, outputs: str, seed: int | None,
                 cache_dir: str | None):
        if not isinstance(mesh, DeviceMesh):
            raise ValueError(f"autopar.backend needs the job's DeviceMesh (init_device_mesh(..., mesh_dim_names=...)), "
                             f"got {type(mesh).__name__}")
        from autopar.runtime import check_mesh

        check_mesh(mesh)
        if inner not in INNER:
            raise ValueError(f"inner={inner!r}: use one of {INNER}")
        if outputs not in OUTPUTS:
            raise ValueError(f"outputs={outputs!r}: use one of {OUTPUTS}")
        config = config or Config()
        if config.microbatches not in (None, 1) or config.pipeline is not None or _pipeline_axis(mesh):
            raise ValueError("the torch.compile backend runs plans of one microbatch without pipeline stages for now: "
                             "leave Config.microbatches and Config.pipeline unset and use a mesh without a pp axis, or "
                             "use autopar.parallelize (pm.step) for microbatches and pipelines")
        self.mesh, self.config, self.inner, self.outputs, self.seed = mesh, config, inner, outputs, seed
        self.cache_dir = cache_dir
        self.stats = {"compiles": 0, "planned": 0, "reused": 0, "replicated": 0}
        # Per planned graph: seconds to capture, to plan (or check a cached plan) and to generate the Program;
        # `inner_s`: seconds Inductor spent compiling the programs' graphs (on their first calls).
        self.timings: list[dict] = []
        self.inner_s = [0.0]
        compat.implicit_replication_in_dynamo()  # torch._dynamo.reset() drops it; a new backend brings it back
        self._plans: dict[str, Plan] = {}

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]):
        guards = compat.dynamo_guards()
        with compat.outside_dynamo():
            compiled, installs = self._compile(gm, example_inputs)
        # The DTensors take the plain tensors' places before Dynamo builds its guards, so the guards describe
        # them: later calls run without a recompile.
        for install, _, _ in installs:
            install()
        compat.retarget_tensor_guards(guards, {id(old): (old, new) for _, old, new in installs})
        compat.implicit_replication_in_dynamo()  # so Dynamo can trace the module again (new shapes, grad mode)
        return compiled

    def _compile(self, gm: fx.GraphModule, example_inputs: Sequence[Any]):
        from autopar import runtime

        runtime.check_mesh(self.mesh)
        self.stats["compiles"] += 1
        graph = _GraphInputs.of(gm, list(example_inputs))
        _check_owner(graph, self)
        if graph.replicated:
            return self._replicated(gm, graph)
        step = _GraphStep(graph.root, gm, graph, example_inputs)
        key = _graph_key(gm, graph, self.mesh, self.config, self.inner)
        # Parameters an earlier graph (or an earlier compile of this one) sharded keep their placements; values
        # crossing a graph break are replicated.
        pins = {fqn: tuple(p.placements) for fqn, p in graph.root.named_parameters() if isinstance(p, DTensor)}
        pins.update({fqn: _replicate(self.mesh) for fqn in graph.crossing.values()})
        # Pins match in order, first wins: these before the user's globs.
        config = self.config.with_(pins={**pins, **dict(self.config.pins or {})}) if pins else self.config
        program, plan_reused = self._program(step, graph, config, key)
        self.stats["reused" if plan_reused else "planned"] += 1
        params, buffers, installs = _shard_in_place(graph, program, self.mesh, self)
        return _CompiledStep(program, graph, params, buffers, self.mesh, self.inner, self.outputs,
                             runtime.agree_on_seed(self.seed), self.inner_s), installs

    def _replicated(self, gm: fx.GraphModule, graph: "_GraphInputs") -> tuple["_ReplicatedGraph", list]:
        """A graph before a graph break (no loss): its plain parameters become replicated DTensors, and it runs
        on every rank as Dynamo traced it."""
        from autopar.runtime.state import shard_real

        installs, params = [], {}
        for i, fqn in graph.params.items():
            p = graph.root.get_parameter(fqn)
            if not isinstance(p, DTensor):
                params[i] = _replacement(graph.root, p, shard_real(p, self.mesh, _replicate(self.mesh)), fqn, self,
                                         installs)
        self.stats["replicated"] += 1
        return _ReplicatedGraph(gm), installs

    def _program(self, step: "_GraphStep", graph: "_GraphInputs", config: Config, key: str):
        """This rank's Program of the graph: the plan cached under `key` when there is one (checked against this
        capture), else rank 0 plans; every rank then runs the same plan."""
        from autopar import runtime
        from autopar.codegen.lower import multi_axis_grad_reductions
        from autopar.compiler import capture_step, fingerprint, forward_only, reject_collectives, solve
        from autopar.plan_check import check_plan

        t0 = time.perf_counter()
        with forward_only(step) if graph.forward_only else contextlib.nullcontext():
            comp = capture_step(step, self.mesh, graph.inputs, {}, _loss_and_outputs, config, template_layers=None,
                                microbatches=1)
        t1 = time.perf_counter()
        reject_collectives(comp.captured)
        cached = self._cached(key)
        reused = [cached is not None]

        def make() -> Plan:
            if cached is not None:
                check_plan(cached, comp)
                return cached
            return solve(comp)

        # Every rank must agree whether the plan was reused, so rank 0 decides (it alone may hold a disk cache).
        plan = runtime.agree_on_plan(make, None, None, fingerprint(comp))
        if plan.pipeline is not None or plan.microbatches > 1:
            raise ValueError("the torch.compile backend runs plans of one microbatch without pipeline stages for now; "
                             "use autopar.parallelize for microbatches and pipelines")
        self._store(key, plan)
        t2 = time.perf_counter()
        rank = runtime.rank_spec(self.mesh, multi_axis_grad_reductions(plan, comp.captured))
        program = comp.program(rank, plan)
        self.timings.append({"capture_s": t1 - t0, "plan_s": t2 - t1, "codegen_s": time.perf_counter() - t2,
                             "reused": reused[0]})
        return program, reused[0]

    def _cached(self, key: str) -> Plan | None:
        if key in self._plans:
            return self._plans[key]
        path = self._path(key)
        if path is not None and os.path.exists(path):
            with open(path) as f:
                return Plan.from_json(f.read())
        return None

    def _store(self, key: str, plan: Plan) -> None:
        self._plans[key] = plan
        path = self._path(key)
        if path is not None and not os.path.exists(path) and _rank() == 0:
            os.makedirs(self.cache_dir, exist_ok=True)
            tmp = f"{path}.tmp{os.getpid()}"
            with open(tmp, "w") as f:
                f.write(plan.to_json())
            os.replace(tmp, path)

    def _path(self, key: str) -> str | None:
        return os.path.join(self.cache_dir, f"plan-{key[:32]}.json") if self.cache_dir else None


def _rank() -> int:
    from autopar.runtime import world

    return world()[1]


def _pipeline_axis(mesh: DeviceMesh) -> bool:
    from autopar.mesh import pipeline_axis

    return pipeline_axis(mesh.mesh_dim_names or ()) is not None


def _loss_and_outputs(out, *inputs):
    """The capture's loss function: `_GraphStep` already returns (loss, *other outputs)."""
    return out


# --- the graph's inputs: parameters, buffers and the call's tensors ----------------------------------------------
@dataclasses.dataclass
class _GraphInputs:
    """Which graph input is which: `params` and `buffers` map input positions to FQNs under `root`; `inputs` are
    the positions of the call's own tensors (the captured model's arguments, in order); `loss` is the position
    of the loss among the graph's outputs, which number `n_outputs`.

    `forward_only`: traced under no_grad, planned and run without a backward. `replicated`: a graph before a
    graph break, which returns values that require grad but no loss: it runs unplanned on every rank, on the
    whole batch, with its parameters replicated. `crossing`: input positions of values a graph before a break
    computed, which need their gradient: each is planned as a replicated stand-in parameter named
    `BREAK_PREFIX<k>`, whose gradient flows back into the earlier graph."""

    root: nn.Module
    params: dict[int, str]
    buffers: dict[int, str]
    input_positions: list[int]
    inputs: tuple
    loss: int
    n_outputs: int
    n_flat: int
    forward_only: bool = False
    replicated: bool = False
    crossing: dict[int, str] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, gm: fx.GraphModule, example: list) -> "_GraphInputs":
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
            return cls(root, params, buffers, positions, tuple(example[i] for i in positions), -1, len(values),
                       len(example), replicated=True)
        if loss is None:
            raise ValueError("the compiled graph returns no scalar loss that requires grad: the autopar backend "
                             "compiles training steps that end in their loss. Compute the loss inside the compiled "
                             "module (e.g. call it with labels=...), call it with grad enabled, and keep the code "
                             "from its inputs to the loss free of graph breaks (print, .item(), data-dependent "
                             "branches); torch._dynamo.explain(model)(*inputs) lists them")
        return cls(root, params, buffers, positions, tuple(example[i] for i in positions), loss, len(values),
                   len(example), forward_only, crossing=crossing)


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


# --- the graph as a module autopar captures -----------------------------------------------------------------------
class _GraphStep(nn.Module):
    """Runs a Dynamo graph with the root module's parameters and buffers looked up by FQN (so capture's fake
    state and names apply) and the call's tensors as arguments; returns (loss, *other outputs). It shares the
    root's submodules, parameters and buffers: FQNs, tied weights and repeated layers are the root's."""

    def __init__(self, root: nn.Module, gm: fx.GraphModule, graph: _GraphInputs, example: Sequence[Any]):
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
        others = [o for k, o in enumerate(outs) if k != g.loss]
        return (outs[g.loss], *others) if others else outs[g.loss]


class _Annotated(fx.Interpreter):
    """Runs a Dynamo graph node by node, each under the module path Dynamo recorded for it, so the traced ATen
    nodes (and the backward nodes derived from them) carry their module's FQN."""

    def run_node(self, n: fx.Node) -> Any:
        path = compat.dynamo_module_path(n) if n.op == "call_function" else None
        if path is None:
            return super().run_node(n)
        with compat.annotate(MODULE_KEY, path):
            return super().run_node(n)


def _graph_key(gm: fx.GraphModule, graph: _GraphInputs, mesh: DeviceMesh, config: Config, inner: str) -> str:
    """The plan cache's key: the graph's ops and data flow, what each input is (FQN, or the call's k-th tensor)
    with its shape and dtype, the mesh and the config."""
    index: dict[fx.Node, int] = {}
    parts = []
    for i, n in enumerate(gm.graph.nodes):
        index[n] = i
        if n.op == "placeholder":
            v = n.meta.get("example_value")
            parts.append(f"in|{i}|{tuple(v.shape) if isinstance(v, torch.Tensor) else None}|{getattr(v, 'dtype', None)}")
            continue
        args = fx.node.map_arg((n.args, n.kwargs), lambda a: f"%{index[a]}")
        target = getattr(n.target, "__qualname__", None) or str(n.target)
        parts.append(f"{n.op}|{getattr(n.target, '__module__', '')}.{target}|{args}")
    for i, x in enumerate(graph.inputs):
        parts.append(f"input/{i}|{tuple(x.shape)}|{x.dtype}")
    parts += [f"crossing/{name}|{pos}" for pos, name in sorted(graph.crossing.items())]  # shapes: placeholders
    root = graph.root
    for pos, fqn in sorted({**graph.params, **graph.buffers}.items()):
        t = root.get_parameter(fqn) if pos in graph.params else root.get_buffer(fqn)
        parts.append(f"{pos}|{fqn}|{tuple(t.shape)}|{t.dtype}")
    parts.append(json.dumps([list(mesh.mesh_dim_names), list(mesh.mesh.shape), mesh.device_type,
                             config.to_json(), inner, graph.forward_only], sort_keys=True, default=str))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


# --- parameters as DTensors, in place ------------------------------------------------------------------------------
# id(DTensor parameter) -> (a reference to it, the Backend that made it); ids, as tensors compare by value.
_SHARDED_BY: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def _sharded_by(p: torch.Tensor) -> "Backend | None":
    ref, owner = _SHARDED_BY.get(id(p), (None, None))
    return owner() if ref is not None and ref() is p else None


def _check_owner(graph: _GraphInputs, backend_obj: Backend) -> None:
    """A parameter another backend (another mesh or config) sharded cannot be planned again here."""
    for fqn in graph.params.values():
        p = graph.root.get_parameter(fqn)
        owner = _sharded_by(p)
        if isinstance(p, DTensor) and owner is not backend_obj:
            raise ValueError(f"parameter {fqn} is already a DTensor, sharded by "
                             f"{'another autopar backend' if owner else 'something other than this backend'}: "
                             "modules that share parameters must be compiled with one backend object "
                             "(b = autopar.backend(mesh); torch.compile(m1, backend=b); torch.compile(m2, backend=b)), "
                             "and a module already parallelized (FSDP, DTensor, autopar.parallelize) cannot be "
                             "compiled with it")


def _replicate(mesh: DeviceMesh) -> tuple:
    from torch.distributed.tensor import Replicate

    return tuple(Replicate() for _ in mesh.mesh.shape)


def _replacement(root: nn.Module, old: torch.Tensor, value: DTensor, fqn: str, backend_obj: Backend,
                 installs: list) -> nn.Parameter:
    """A new Parameter holding `value`, and (appended to `installs`) the call that puts it in place of `old`
    under each of its names in `root`, remembering `old` so an optimizer that still holds it fails clearly."""
    from autopar.runtime.state import owner

    new = nn.Parameter(value, requires_grad=old.requires_grad)
    _SHARDED_BY[id(new)] = (weakref.ref(new), weakref.ref(backend_obj))

    def install() -> None:
        for name, p in root.named_parameters(remove_duplicate=False):
            if p is old:
                mod, attr = owner(root, name)
                mod._parameters[attr] = new
        _StaleOptimizerCheck.replaced(old, fqn)

    installs.append((install, old, new))
    return new


def _shard_in_place(graph: _GraphInputs, program, mesh: DeviceMesh, backend_obj: Backend):
    """Every parameter and buffer the program reads, as a DTensor in its layout: returns {fqn: parameter},
    {fqn: buffer} and (install, old, new) per replaced tensor: the call that puts it in the root module under
    each of its names (the backend runs them before Dynamo builds its guards). A plain
    parameter is replaced by a new Parameter object (`_replacement`); a DTensor parameter stays as it is (the
    plan was pinned to its placements). Stand-ins for values crossing a graph break are skipped."""
    from autopar.runtime.state import owner, shard_real

    root = graph.root
    params, installs = {}, []
    for spec in program.params:
        if spec.name.startswith(BREAK_PREFIX):
            continue
        old = root.get_parameter(spec.name)
        layout = tuple(spec.layout)
        if isinstance(old, DTensor):  # pinned where it is, so the plan keeps it there
            if tuple(old.placements) != layout:
                raise ValueError(f"parameter {spec.name} is already sharded as {tuple(old.placements)} but this graph's "
                                 f"plan places it as {layout}: a pin in Config.pins conflicts with its placement")
            params[spec.name] = old
            continue
        if old.is_meta:
            raise ValueError(f"parameter {spec.name} is on the meta device: the torch.compile backend needs the "
                             "model's real weights (autopar.parallelize initializes meta-device models)")
        params[spec.name] = _replacement(root, old, shard_real(old, mesh, layout), spec.name, backend_obj, installs)
    buffers = {}
    for spec in program.buffers:
        old = root.get_buffer(spec.name)
        layout = tuple(spec.layout)
        if isinstance(old, DTensor):
            new = old if tuple(old.placements) == layout else old.redistribute(mesh, layout)
        else:
            new = shard_real(old, mesh, layout)
        mod, attr = owner(root, spec.name)
        installs.append((lambda mod=mod, attr=attr, new=new: mod._buffers.__setitem__(attr, new), old, new))
        buffers[spec.name] = new
    return params, buffers, installs


class _StaleOptimizerCheck:
    """Parameters the backend replaced by DTensors; an optimizer that still holds one raises at its first step
    (it would update a tensor the model no longer reads)."""

    _old: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()
    _fqn: dict[int, str] = {}
    _checked: "weakref.WeakSet" = weakref.WeakSet()
    _hook = None

    @classmethod
    def replaced(cls, old: torch.Tensor, fqn: str) -> None:
        cls._old[id(old)] = old
        cls._fqn[id(old)] = fqn
        if cls._hook is None:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            cls._hook = register_optimizer_step_pre_hook(cls._check)

    @classmethod
    def _check(cls, opt: torch.optim.Optimizer, args, kwargs) -> None:
        if opt in cls._checked:
            return
        for group in opt.param_groups:
            for p in group["params"]:
                if cls._old.get(id(p)) is p:
                    raise ValueError(f"this optimizer holds the parameter {cls._fqn[id(p)]} as it was before the "
                                     "autopar backend sharded the model (the first call of the compiled module "
                                     "replaced it with a DTensor): make the optimizer after the first call, "
                                     "`opt = torch.optim.AdamW(model.parameters())`, as with FSDP2's fully_shard")
        cls._checked.add(opt)


# --- running the program -------------------------------------------------------------------------------------------
class _CompiledStep:
    """The compiled form of one graph: takes the graph's flat inputs (the DTensor parameters and buffers, the
    call's tensors), runs the rank's Program (forward now, backward when the loss is differentiated) and
    returns the graph's outputs: the replicated loss and the others as DTensors (or full tensors)."""

    def __init__(self, program, graph: _GraphInputs, params: dict, buffers: dict, mesh: DeviceMesh, inner: str,
                 outputs: str, seed: int, inner_s: list):
        from autopar.runtime.module import _Runner
        from autopar.runtime.state import mesh_coords, mesh_device

        self.program, self.mesh, self.outputs = program, mesh, outputs
        self._device = mesh_device(mesh)
        program.forward.to(self._device)  # constants the program holds
        program.backward.to(self._device)
        if inner == "inductor":
            from autopar.codegen import functional

            # Each graph compiled by Inductor on its first call; not through torch.compile, as Dynamo is
            # disabled while a backend's compiled function runs.
            self._runner = _Runner(functional(program), mesh.device_type)
            self._runner._graphs = tuple(g if g is None else _InductorGraph(g, inner_s) for g in self._runner._graphs)
        else:
            self._runner = _Runner(program, mesh.device_type)
        self._coords, self._sizes = mesh_coords(mesh), tuple(mesh.mesh.shape)
        by_fqn = {fqn: i for i, fqn in {**graph.params, **graph.crossing}.items()}
        self._param_pos = [by_fqn.get(n) for n in program.param_names]
        self._params = [params.get(n) for n in program.param_names]  # unread by the graph: not among its inputs
        self._crossing = {by_fqn[n] for n in graph.crossing.values()}
        self._replicate = _replicate(mesh)
        bpos = {fqn: i for i, fqn in graph.buffers.items()}
        self._buffer_pos = [bpos.get(n) for n in program.buffer_names]
        self._buffers = [buffers[n] for n in program.buffer_names]
        self._input_pos = [graph.input_positions[spec.leaf] for spec in program.inputs]
        self._loss, self._n_outputs = graph.loss, graph.n_outputs
        self._seed, self._step = seed, 0

    def __call__(self, *flat: Any) -> list:
        from autopar.runtime.module import _TrainStep

        compat.implicit_replication_in_dynamo()  # again: torch._dynamo.reset() clears it
        params = [p if i is None else self._crossed(flat[i]) if i in self._crossing else flat[i]
                  for i, p in zip(self._param_pos, self._params)]
        buffers = [_local(b if i is None else flat[i]) for i, b in zip(self._buffer_pos, self._buffers)]
        inputs = [self._local_input(flat[i], spec) for i, spec in zip(self._input_pos, self.program.inputs)]
        seed = self._next_seed()
        if torch.is_grad_enabled():
            loss, *outs = _TrainStep.apply(self._runner, len(params), *params, *buffers, *inputs, *seed)
        else:
            loss, outs, _, _ = self._runner.forward(*[compat.dtensor_local(p) for p in params], *buffers, *inputs,
                                                    *seed)
        return self._results(loss, outs)

    def _crossed(self, x: torch.Tensor) -> DTensor:
        """A value an earlier graph computed, as the replicated DTensor its stand-in parameter is: the gradient
        the program returns for it flows back into that graph."""
        if isinstance(x, DTensor):
            return x.redistribute(self.mesh, self._replicate)
        return DTensor.from_local(x, self.mesh, self._replicate, run_check=False)

    def _results(self, loss: torch.Tensor, outs) -> list:
        from autopar.runtime.state import as_dtensor

        others = [as_dtensor(o, self.mesh, tuple(spec.layout), spec.shape) for o, spec in zip(outs, self.program.outputs)]
        if self.outputs == "global":
            others = [o.full_tensor() for o in others]
        others.insert(self._loss, loss)
        return others

    def _next_seed(self) -> list:
        from autopar.codegen.rng import step_seed

        if not self.program.takes_seed:
            return []
        self._step += 1
        seed = step_seed(self._seed, self._step - 1)
        return [torch.tensor(seed, dtype=torch.int64) if self._runner.seed_as_tensor else seed]

    def _local_input(self, x: torch.Tensor, spec) -> torch.Tensor:
        from autopar.runtime.state import local_shard

        layout = tuple(spec.layout)
        if isinstance(x, DTensor):
            if tuple(x.placements) == layout:
                return x.to_local()
            x = x.full_tensor()
        return local_shard(x, layout, self._coords, self._sizes).to(self._device).contiguous()


class _InductorGraph:
    """A graph compiled by Inductor for the arguments of its first call (the Program's shapes are static)."""

    def __init__(self, gm: fx.GraphModule, seconds: list):
        self.gm, self.fn, self.seconds = gm, None, seconds

    def __call__(self, *args: Any):
        if self.fn is None:
            t0 = time.perf_counter()
            self.fn = compat.inductor_compile(self.gm, list(args))
            self.seconds[0] += time.perf_counter() - t0
        return self.fn(*args)


class _ReplicatedGraph:
    """A graph before a graph break, run as Dynamo traced it on every rank: DTensor inputs (parameters, values
    of earlier graphs) as full tensors, differentiably, so gradients reach the DTensor parameters."""

    def __init__(self, gm: fx.GraphModule):
        self.gm = gm

    def __call__(self, *flat: Any):
        return self.gm(*[x.full_tensor() if isinstance(x, DTensor) else x for x in flat])


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


__all__ = ["backend", "Backend"]
