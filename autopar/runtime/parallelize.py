"""parallelize(): capture the full graph, agree on one plan across ranks, generate this rank's program and
wrap it with the model's weights as a ParallelModule."""
from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autopar.codegen import RankSpec, generate
from autopar.codegen.lower import multi_axis_grad_reductions
from autopar.config import Config
from autopar.errors import PlanMismatchError
from autopar.layout import divides, fmt_layout
from autopar.plan import Plan
from autopar.runtime.module import ParallelModule
from autopar.runtime.state import empty_shard, init_meta, mesh_coords, shard_real


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def rank_spec(mesh: DeviceMesh, flatten: Iterable[tuple[int, ...]] = ()) -> RankSpec:
    """This rank's coordinates and the process group behind each axis of a real mesh, plus the flattened
    groups over the axes tuples in `flatten` (created here, so every rank must pass the same ones)."""
    from autopar import _torch_compat as compat

    names = tuple(mesh.mesh_dim_names)
    groups = tuple(compat.group_name_of(mesh, n) for n in names)
    flat = tuple((axes, compat.flattened_group_name(mesh, tuple(names[a] for a in axes)))
                 for axes in sorted(set(flatten)))
    return RankSpec(names, tuple(int(s) for s in mesh.mesh.shape), mesh_coords(mesh), groups, mesh.device_type,
                    flat)


def _check_mesh(mesh: DeviceMesh, world: int) -> None:
    if mesh.mesh_dim_names is None:
        raise ValueError("the mesh needs axis names: init_device_mesh(..., mesh_dim_names=('dp', 'tp'))")
    if getattr(mesh, "_autopar_target_device", None) is not None:
        raise ValueError("parallelize needs a real DeviceMesh over the job's ranks; a fake mesh only plans "
                         "(use autopar.plan, or autopar.codegen.generate with RankSpec.fake to read the program)")
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("torch.distributed is not initialized: launch with torchrun and call "
                         "dist.init_process_group before building the mesh")
    if mesh.size() != world:
        raise ValueError(f"the mesh has {mesh.size()} ranks {dict(zip(mesh.mesh_dim_names, mesh.mesh.shape))} but "
                         f"the job has {world}; build the mesh over every rank (init_device_mesh with a shape whose "
                         "product is the world size)")


def _reject_collectives(cap) -> None:
    from autopar import _torch_compat as compat

    for node in cap.gm.graph.nodes:
        ns, _ = compat.op_namespace_and_name(node.target)
        if node.op == "call_function" and ns in compat.C10D_NAMESPACES:
            raise ValueError(f"the model already communicates: {node.target} in {cap.module_of.get(node) or 'the root'} "
                             f"({cap.names.get(node, node.name)}). autopar inserts every collective itself; pass the "
                             "single-device model, without explicit collectives, DTensor or FSDP/TP wrappers")


def check_plan(plan: Plan, ctx) -> None:
    """Raise PlanMismatchError, naming the first mismatch, unless `plan` fits this capture: same mesh and
    depth, and every node of the graph has a plan entry with the same op, run as many times per step, whose
    layouts divide this graph's shapes. A plan made on a template of the first layers fits the full-depth
    graph when the model's layers are alike."""
    from autopar.passes.annotate_shapes import layer_differences
    from autopar.passes.build_plan import fingerprint, key_count, node_op

    mesh = ctx.mesh
    if tuple(plan.mesh.axis_names) != tuple(mesh.axis_names) or tuple(plan.mesh.shape) != tuple(mesh.shape):
        raise PlanMismatchError(f"the plan is for mesh {dict(zip(plan.mesh.axis_names, plan.mesh.shape))}, "
                                f"parallelize got {dict(zip(mesh.axis_names, mesh.shape))}; re-plan for this mesh")
    here = ctx.precision.name
    if plan.mixed_precision is not None and plan.mixed_precision != here:
        raise PlanMismatchError(f"the plan was made for mixed_precision={plan.mixed_precision!r}, this run resolves "
                                f"Config(mixed_precision={ctx.config.mixed_precision!r}) on a {mesh.device_type} mesh "
                                f"to {here!r}; pass Config(mixed_precision={plan.mixed_precision!r}) or re-plan")
    if plan.fingerprint == fingerprint(ctx):
        return
    cap = ctx.captured
    for b in cap.blocks:
        if plan.blocks.get(b.prefix, b.count) != b.count:
            raise PlanMismatchError(f"the plan was made for {plan.blocks[b.prefix]} layers of {b.prefix}, this model "
                                    f"has {b.count}; re-plan with this model")
    differ = layer_differences(ctx)
    # Layers unlike one another make a plan of the first layers (a template capture) miss or miscount ops.
    cause = (": the plan was made for another model, or on a template of this model's first layers, which "
             f"cannot stand for the others since its layers differ ({differ[0]}); plan with "
             "Config(template_layers=None)" if differ else
             ": the plan was made for another model; re-plan with this model")
    for key, nodes in ctx.members.items():
        node = nodes[0]
        if node.op == "call_function" and node.target.__name__ == "getitem":
            continue
        np_ = plan.nodes.get(key)
        op = node_op(key, node)
        if np_ is None:
            raise PlanMismatchError(f"the plan has no entry for {key} ({op}){cause}")
        if np_.op != op:
            raise PlanMismatchError(f"the plan computes {key} with {np_.op}, this model with {op}{cause}")
        count = key_count(ctx, key)
        if count is not None and f"{np_.count:.6g}" != count:
            raise PlanMismatchError(f"the plan runs {key} ({op}) {np_.count:.6g} times per step, this model "
                                    f"{count} times{cause}")
        vals = node.meta["val"] if isinstance(node.meta["val"], (list, tuple)) else [node.meta["val"]]
        for v, lay in zip(vals, np_.outs):
            if isinstance(v, torch.Tensor) and not divides(tuple(v.shape), lay, mesh.shape):
                raise PlanMismatchError(f"the plan lays out {key} as {fmt_layout(lay)}, which does not divide its "
                                        f"shape {list(v.shape)} here: the inputs or model differ from the planned "
                                        "ones; re-plan")
    known = set(ctx.members)
    extra = [k for k in plan.nodes if k not in known]
    if extra:
        raise PlanMismatchError(f"the plan has an entry for {extra[0]}, which this model lacks{cause}")
    for fqn, node in cap.params.items():
        want = plan.param_numel.get(ctx.key[node].split("/", 1)[1])
        have = node.meta["val"].numel()
        if want is not None and want != have:
            raise PlanMismatchError(f"parameter {fqn} has {have} elements, the plan was made for {want}; re-plan")


def _plan_here(ctx) -> Plan:
    from autopar.passes import PASSES, annotate_shapes_pass, run_passes

    run_passes(ctx.captured.gm, ctx, tuple(p for p in PASSES if p is not annotate_shapes_pass))
    return ctx.plan


def _all_ranks_ok(world: int, error: str | None) -> None:
    """Raise the same PlanMismatchError on every rank when any rank found a problem (so none is left waiting
    in a collective the others never reach)."""
    errors: list[Any] = [None] * world
    dist.all_gather_object(errors, error)
    bad = [(r, e) for r, e in enumerate(errors) if e is not None]
    if bad:
        ranks = [r for r, _ in bad]
        raise PlanMismatchError(f"ranks {ranks}: {bad[0][1]}" if len(ranks) < world else bad[0][1])


def _agree_on_plan(ctx, plan: Plan | None, world: int, rank: int) -> Plan:
    """Rank 0 plans (or checks the given plan) and broadcasts it; every rank checks what it received."""
    from autopar.passes.build_plan import fingerprint

    if world == 1:
        if plan is not None:
            check_plan(plan, ctx)
            return plan
        return _plan_here(ctx)
    error = None
    if plan is not None:
        try:
            check_plan(plan, ctx)
        except PlanMismatchError as e:
            error = str(e)
    _all_ranks_ok(world, error)
    msg: list[Any] = [None]
    if rank == 0:
        try:
            p = plan if plan is not None else _plan_here(ctx)
            msg = [("ok", p.to_json(), p.digest(), fingerprint(ctx))]
        except Exception as e:  # noqa: BLE001 - the other ranks must not wait forever
            dist.broadcast_object_list([("error", f"{type(e).__name__}: {e}", None, None)], src=0)
            raise
    dist.broadcast_object_list(msg, src=0)
    status, text, digest, graph0 = msg[0]
    if status != "ok":
        raise RuntimeError(f"planning failed on rank 0: {text}")
    got = Plan.from_json(text) if rank != 0 else (plan if plan is not None else ctx.plan)
    error = None
    if got.digest() != digest:
        error = f"the plan rank 0 sent arrived with digest {got.digest()}, not {digest}"
    elif plan is not None and plan.digest() != digest:
        error = "each rank must pass the same plan= (this one differs from rank 0's)"
    elif fingerprint(ctx) != graph0:
        error = ("the graph captured here differs from rank 0's (model, example inputs or loss differ across "
                 "ranks); every rank must build the same model and pass the same example inputs")
    _all_ranks_ok(world, error)
    return got


def tied_names(model: nn.Module, cap) -> dict[str, list[str]]:
    """Graph parameter FQN -> the other names of the same tensor (tied weights, one graph input)."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    aliases = {}
    for names in by_id.values():
        canon = next((n for n in names if n in cap.params), None)
        if canon is not None and len(names) > 1:
            aliases[canon] = [n for n in names if n != canon]
    return aliases


def _tensors(model: nn.Module, cap, plan: Plan, mesh: DeviceMesh, seed: int | None, aliases: dict[str, list[str]]):
    """DTensor params and buffers with the plan's layouts, from real weights or by init on the local shards."""
    def layout(name: str) -> tuple:
        np_ = plan.nodes.get(name) or plan.nodes[plan.key(name)]
        return tuple(np_.outs[0])

    out: dict[str, tuple[str, Any]] = {}
    real: dict[str, torch.Tensor] = {}
    meta = False
    for kind, table in (("param", cap.params), ("buffer", cap.buffers)):
        for fqn, node in table.items():
            t = model.get_parameter(fqn) if kind == "param" else model.get_buffer(fqn)
            lay = layout(cap.names[node])
            if t.is_meta:
                meta = True
                out[fqn] = (kind, empty_shard(t.shape, t.dtype, mesh, lay))
            else:
                real[fqn] = t
                out[fqn] = (kind, shard_real(t, mesh, lay))
    if meta:
        done = init_meta(model, out, aliases, seed, mesh)
        for fqn, t in real.items():  # weights the user gave win over the initializer
            done[fqn] = shard_real(t, mesh, out[fqn][1].placements)
    else:
        done = {fqn: dt for fqn, (_, dt) in out.items()}
    params = {f: done[f] for f in cap.params}
    buffers = {f: done[f] for f in cap.buffers}
    return params, buffers


def _non_persistent(model: nn.Module) -> set[str]:
    out = set()
    for mod_name, mod in model.named_modules():
        for b in getattr(mod, "_non_persistent_buffers_set", ()):
            out.add(f"{mod_name}.{b}" if mod_name else b)
    return out


def parallelize(model: nn.Module, mesh: DeviceMesh, example_inputs: Sequence[Any], *,
                example_kwargs: dict | None = None, loss_fn: Callable | None = None, config: Config | None = None,
                plan: Plan | None = None, seed: int | None = None, compile: bool = False) -> ParallelModule:
    """Parallelize `model` over `mesh` for training: returns a ParallelModule whose call runs this rank's
    generated program and returns the loss.

    Every rank calls this with the same model (same seed, or on the meta device) and example inputs. Without
    `plan`, rank 0 plans on the full graph and broadcasts the plan. A meta-device model gets only its local
    shards allocated, initialized by `model.init_weights(seed)` (see autopar.runtime.state.init_meta).
    `seed` is also the base seed of dropout masks (autopar/codegen/rng.py); without it, rank 0's
    `torch.initial_seed()` is, sent to every rank.
    A given plan runs in the mixed precision it records, unless `config.mixed_precision` resolves to another
    one, which is refused.
    `compile=True` runs the training program's forward and backward graphs through torch.compile (inductor)
    instead of eagerly: each compiles on its first call (seconds to minutes on CPU), on every rank; the
    eval-mode programs stay eager.
    The ParallelModule keeps a reference to `model`: its eval mode re-traces the model's structure (see
    autopar.runtime.evaluate), so real weights of a model not on the meta device stay alive with it.
    """
    from autopar.api import make_context
    from autopar.passes import annotate_shapes_pass
    from autopar.runtime.evaluate import Evaluator

    config = config or Config()
    config = config.with_plan_precision(plan)  # a config that leaves it open runs the plan's
    world, rank = _world()
    _check_mesh(mesh, world)
    ctx = make_context(model, mesh, example_inputs, example_kwargs, loss_fn, config, template_layers=None)
    cap = ctx.captured
    _reject_collectives(cap)
    annotate_shapes_pass(cap.gm, ctx)
    plan = _agree_on_plan(ctx, plan, world, rank)
    aliases = tied_names(model, cap)
    program = generate(plan, cap, rank_spec(mesh, multi_axis_grad_reductions(plan, cap)))
    params, buffers = _tensors(model, cap, plan, mesh, seed, aliases)
    input_specs = [(tuple(n.meta["val"].shape), n.meta["val"].dtype) for n in cap.inputs]
    leaves, layouts = input_layouts(plan, cap)
    requires_grad = {f: model.get_parameter(f).requires_grad for f in cap.params}
    placements = {f: tuple(t.placements) for table in (params, buffers) for f, t in table.items()}
    evaluator = Evaluator(model, mesh, loss_fn, config, placements)
    return ParallelModule(plan=plan, program=program, mesh=mesh, params=params, buffers=buffers, aliases=aliases,
                          non_persistent=_non_persistent(model), input_specs=input_specs,
                          input_layouts=layouts, input_leaves=leaves, requires_grad=requires_grad,
                          evaluator=evaluator, rng_seed=_agree_on_seed(seed, world), compile=compile)


def _agree_on_seed(seed: int | None, world: int) -> int:
    """The base seed of dropout masks, the same on every rank: `seed`, or rank 0's torch.initial_seed()."""
    if seed is not None:
        return int(seed)
    value = [torch.initial_seed()]
    if world > 1:
        dist.broadcast_object_list(value, src=0)
    return int(value[0])


def input_layouts(plan: Plan, cap) -> tuple[list[int], list[tuple]]:
    """Per tensor input of the graph: its index among the call's flattened (args, kwargs), and its layout."""
    leaves = [int(getattr(n.meta.get("desc"), "idx", i)) for i, n in enumerate(cap.inputs)]
    layouts = [tuple(plan.nodes.get(cap.names[n]) and plan.nodes[cap.names[n]].outs[0]
                     or plan.nodes[plan.key(cap.names[n])].outs[0]) for n in cap.inputs]
    return leaves, layouts
