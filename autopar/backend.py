"""The torch.compile backend: each graph Dynamo hands over is captured (joint forward and backward), planned
and generated through the one driver, the module's parameters become DTensors in the plan's layouts, and the
rank's Program runs as the graph's compiled form.

    cm = torch.compile(model, backend=autopar.backend(mesh))
    out = cm(tokens, labels=tokens)       # first call: plan, shard, compile
    opt = torch.optim.AdamW(model.parameters())

How a Dynamo graph becomes a model autopar can capture: the graph's inputs are the module's parameters and
buffers (Dynamo inlines built-in modules, so they are placeholders whose example values are the tensors
themselves) and the call's tensors. The parameters are found among the live modules by identity, named by
their FQN under the root module that holds them all, and a `GraphStep` (autopar/dynamo_graph.py: an
nn.Module sharing the root's submodules, parameters and buffers, so FQNs, tied weights and repeated layers are
the root's) runs the graph with them; each node runs under the module path Dynamo recorded, so plan keys read `layers.0.attention/fwd/mm`
as under `autopar.parallelize`. The last graph of a step returns a scalar loss that requires grad (the step
autopar trains); its other outputs are returned as DTensors in their planned layouts, not differentiated. A
graph before a graph break returns values that require grad and no loss: it is planned with those values as its
heads (`autopar.capture.HEADS`), which leave it replicated and whose gradients, computed by the later graphs,
run its backward. The rank's Program runs as `autopar.runtime.compiled.CompiledStep`.

The parameters are swapped for DTensors inside the backend call, before Dynamo builds its guards, so the
guards describe the DTensor parameters (`compat.retarget_tensor_guards`) and later calls run the compiled
program without a recompile. An
optimizer made over the old parameter objects before the first call would step stale tensors; its first
`step()` raises instead (`_StaleOptimizerCheck`), as FSDP2's `fully_shard` asks for the optimizer after sharding.
"""
from __future__ import annotations

import contextlib
import os
import time
import weakref
from typing import Any, Sequence

import torch
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from autopar import _torch_compat as compat
from autopar.capture import HEADS
from autopar.config import Config
from autopar.dynamo_graph import BREAK_PREFIX, GraphInputs, GraphStep, graph_key
from autopar.plan import Plan
from autopar.runtime.compiled import CompiledStep

def backend(mesh: DeviceMesh, *, config: Config | None = None, seed: int | None = None,
            cache_dir: str | None = None) -> "Backend":
    """A torch.compile backend that plans, shards and runs a module over `mesh`:
    `torch.compile(model, backend=autopar.backend(mesh))`.

    config.inner_compiler: "inductor" (default) compiles the rank's forward and backward graphs with Inductor
                           (Triton kernels on GPU, C++ on CPU); "eager" runs them as fx graphs.
    config.outputs: "sharded" (default) returns outputs other than the loss as DTensors in their planned layouts
                    (no gather of logits every step); "global" returns full tensors, each output pinned replicated
                    in the plan so the planner prices its gather.
    seed: base seed of dropout masks (default: rank 0's torch.initial_seed()).
    cache_dir: also keep plans on disk, one JSON file per graph, mesh and config, so a new process reuses them.
    Every rank compiles the same model with the same inputs; rank 0 plans and sends the plan to the others."""
    return Backend(mesh, config=config, seed=seed, cache_dir=cache_dir)


class Backend:
    """Compiles Dynamo graphs (see the module docstring). `stats` counts compiles, plans made and plans reused
    from the cache (keyed by graph, input shapes, mesh and config)."""

    def __init__(self, mesh: DeviceMesh, *, config: Config | None, seed: int | None, cache_dir: str | None):
        if not isinstance(mesh, DeviceMesh):
            raise ValueError(f"autopar.backend needs the job's DeviceMesh (init_device_mesh(..., mesh_dim_names=...)), "
                             f"got {type(mesh).__name__}")
        from autopar.runtime import check_mesh

        check_mesh(mesh)
        config = config or Config()
        if config.microbatches not in (None, 1) or config.pipeline is not None or _pipeline_axis(mesh):
            raise ValueError("the torch.compile backend runs plans of one microbatch without pipeline stages for now: "
                             "leave Config.microbatches and Config.pipeline unset and use a mesh without a pp axis, or "
                             "use autopar.parallelize (pm.step) for microbatches and pipelines")
        self.mesh, self.config, self.inner, self.seed = mesh, config, config.inner_compiler, seed
        self.cache_dir = cache_dir
        self.stats = {"compiles": 0, "planned": 0, "reused": 0}
        # Per planned graph: seconds to capture, to plan (or check a cached plan) and to generate the Program;
        # `inner_s`: seconds Inductor spent compiling the programs' graphs (on their first calls).
        self.timings: list[dict] = []
        self.programs: list = []  # this rank's Program of each planned graph, in compile order (print one to read it)
        self.inner_s = [0.0]
        compat.implicit_replication_in_dynamo()  # torch._dynamo.reset() drops it; a new backend brings it back
        compat.checkpointed_regions_in_dynamo()
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
        graph = GraphInputs.of(gm, list(example_inputs))
        _check_owner(graph, self)
        _StaleOptimizerCheck.compiled(graph.root)
        step = GraphStep(graph.root, gm, graph, example_inputs)
        key = graph_key(gm, graph, self.mesh, self.config, self.inner)
        same_graph = graph_key(gm, graph, self.mesh, self.config, self.inner, shapes=False)
        # Parameters an earlier graph (or an earlier compile of this one) sharded keep their placements; values
        # crossing a graph break are replicated.
        pins = {fqn: tuple(p.placements) for fqn, p in graph.root.named_parameters() if isinstance(p, DTensor)}
        pins.update({fqn: _replicate(self.mesh) for fqn in graph.crossing.values()})
        # Pins match in order, first wins: these before the user's globs.
        config = self.config.with_(pins={**pins, **dict(self.config.pins or {})}) if pins else self.config
        program, plan_reused = self._program(step, graph, config, key, same_graph)
        self.stats["reused" if plan_reused else "planned"] += 1
        params, buffers, installs = _shard_in_place(graph, program, self.mesh, self)
        by_fqn = {fqn: i for i, fqn in {**graph.params, **graph.crossing}.items()}
        bpos = {fqn: i for i, fqn in graph.buffers.items()}
        step = CompiledStep(program, [by_fqn.get(n) for n in program.param_names],
                            [params.get(n) for n in program.param_names],  # those the graph reads are its inputs
                            {by_fqn[n] for n in graph.crossing.values()},
                            [bpos.get(n) for n in program.buffer_names], [buffers[n] for n in program.buffer_names],
                            [graph.input_positions[spec.leaf] for spec in program.inputs], graph.loss, self.mesh,
                            self.inner, "global" if graph.heads else self.config.outputs,
                            runtime.agree_on_seed(self.seed), self.inner_s, heads=graph.heads)
        return step, installs

    def _program(self, step: "GraphStep", graph: "GraphInputs", config: Config, key: str, same_graph: str):
        """This rank's Program of the graph: the plan cached under `key` when there is one (checked against this
        capture); else the plan of the same graph at other shapes (`same_graph`) when it fits these (its layouts
        divide them); else rank 0 plans. Every rank then runs the same plan."""
        from autopar import runtime
        from autopar.compiler import fingerprint, reject_collectives, solve
        from autopar.errors import PlanMismatchError
        from autopar.plan_check import check_plan

        t0 = time.perf_counter()
        comp = capture_graph(step, graph, self.mesh, config)
        t1 = time.perf_counter()
        reject_collectives(comp.captured)
        if self.config.outputs == "global" or graph.heads:  # values handed to the code after a break: full
            _replicate_outputs(comp, self.mesh)
        exact = self._cached(key)
        cached = exact or self._cached(same_graph)

        def make() -> Plan:
            if exact is not None:
                check_plan(exact, comp)
                return exact
            if cached is not None:
                try:
                    check_plan(cached, comp)
                    return cached
                except PlanMismatchError:
                    pass
            return solve(comp)

        # Every rank must agree whether the plan was reused, so rank 0 decides (it alone may hold a disk cache).
        plan = runtime.agree_on_plan(make, None, None, fingerprint(comp))
        if plan.pipeline is not None or plan.microbatches > 1:
            raise ValueError("the torch.compile backend runs plans of one microbatch without pipeline stages for now; "
                             "use autopar.parallelize for microbatches and pipelines")
        reused = cached is not None and plan.fingerprint == cached.fingerprint
        self._store(key, plan)
        self._store(same_graph, plan)
        t2 = time.perf_counter()
        rank = runtime.rank_spec(self.mesh)
        program = comp.program(rank, plan)
        self.programs.append(program)
        self.timings.append({"capture_s": t1 - t0, "plan_s": t2 - t1, "codegen_s": time.perf_counter() - t2,
                             "reused": reused})
        return program, reused

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


def _replicate_outputs(comp, mesh: DeviceMesh) -> None:
    """Pin every output other than the loss replicated (Config.pins' "act:" form), so the planner prices
    gathering it inside the program, where it can overlap or be placed early, instead of after the step."""
    keys = {node: key for key, nodes in comp.ctx.members.items() for node in nodes}
    act = {f"act:{keys[o]}": _replicate(mesh) for o in comp.captured.outputs if o in keys}
    comp.ctx.config = comp.ctx.config.with_(pins={**act, **dict(comp.ctx.config.pins or {})})


def _rank() -> int:
    from autopar.runtime import world

    return world()[1]


def _pipeline_axis(mesh: DeviceMesh) -> bool:
    from autopar.mesh import pipeline_axis

    return pipeline_axis(mesh.mesh_dim_names or ()) is not None


def capture_graph(step: GraphStep, graph: GraphInputs, mesh, config: Config):
    """The joint graph of a Dynamo graph's step (the whole graph: no template), as every rank captures it."""
    from autopar.compiler import capture_step, forward_only

    with forward_only(step) if graph.forward_only else contextlib.nullcontext():
        return capture_step(step, mesh, graph.inputs, {}, HEADS if graph.heads else _loss_and_outputs, config,
                            template_layers=None, microbatches=1, read_state_only=True)


def _loss_and_outputs(out, *inputs):
    """The capture's loss function: `GraphStep` already returns (loss, *other outputs)."""
    return out


# --- parameters as DTensors, in place ------------------------------------------------------------------------------
# id(DTensor parameter) -> (a reference to it, the Backend that made it); ids, as tensors compare by value.
_SHARDED_BY: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def _sharded_by(p: torch.Tensor) -> "Backend | None":
    ref, owner = _SHARDED_BY.get(id(p), (None, None))
    return owner() if ref is not None and ref() is p else None


def _check_owner(graph: GraphInputs, backend_obj: Backend) -> None:
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


def _shard_in_place(graph: GraphInputs, program, mesh: DeviceMesh, backend_obj: Backend):
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
    (it would update a tensor the model no longer reads). So does one that holds DTensor parameters and plain
    parameters of the same compiled module: no compiled graph read those, as Dynamo ran the code using them
    eagerly, and torch's fused and foreach paths (clip_grad_norm_, AdamW on GPU) cannot mix the two."""

    _old: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()
    _fqn: dict[int, str] = {}
    _checked: "weakref.WeakSet" = weakref.WeakSet()
    _roots: "weakref.WeakSet" = weakref.WeakSet()  # modules a backend compiled
    _hook = None

    @classmethod
    def compiled(cls, root: nn.Module) -> None:
        cls._roots.add(root)
        cls._install()

    @classmethod
    def _install(cls) -> None:
        if cls._hook is None:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            cls._hook = register_optimizer_step_pre_hook(cls._check)

    @classmethod
    def replaced(cls, old: torch.Tensor, fqn: str) -> None:
        cls._old[id(old)] = old
        cls._fqn[id(old)] = fqn
        cls._install()

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
        held = {id(p) for group in opt.param_groups for p in group["params"]}
        if any(_sharded_by(p) is not None for group in opt.param_groups for p in group["params"]):
            for root in list(cls._roots):
                plain = [n for n, p in root.named_parameters() if id(p) in held and not isinstance(p, DTensor)]
                if plain:
                    raise ValueError(
                        f"the autopar backend sharded this model's parameters but {plain[0]}"
                        f"{f' and {len(plain) - 1} more' if len(plain) > 1 else ''} stayed plain tensors: no compiled "
                        "graph read them, as Dynamo ran the code using them eagerly (a graph break inside a loop, "
                        "such as a print in a layer called from `for layer in self.layers`, makes Dynamo run that "
                        "whole frame eagerly). Move the graph break out of the loop or remove it "
                        "(torch._dynamo.explain(model)(*inputs) lists the breaks), so every parameter is read "
                        "inside a compiled graph")
        cls._checked.add(opt)


__all__ = ["backend", "Backend"]
