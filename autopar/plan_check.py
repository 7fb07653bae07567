"""Whether a Plan fits a capture of a model: same mesh, depth and precision, and every node of the graph planned
with the same op, run as many times per step, in layouts that divide its shapes. Used wherever a plan made
elsewhere (loaded from a file, sent by another rank, made on a template of the layers) meets a model."""
from __future__ import annotations

import torch

from autopar.compiler import Compilation
from autopar.errors import PlanMismatchError
from autopar.layout import divides, fmt_layout
from autopar.plan import Plan


def check_plan(plan: Plan, comp: Compilation) -> None:
    """Raise PlanMismatchError, naming the first mismatch, unless `plan` fits this capture: same mesh and
    depth, and every node of the graph has a plan entry with the same op, run as many times per step, whose
    layouts divide this graph's shapes. A plan made on a template of the first layers fits the full-depth
    graph when the model's layers are alike."""
    from autopar.passes.annotate_shapes import layer_differences
    from autopar.passes.build_plan import fingerprint, key_count, node_op

    ctx = comp.ctx
    mesh = ctx.mesh
    if tuple(plan.mesh.axis_names) != tuple(mesh.axis_names) or tuple(plan.mesh.shape) != tuple(mesh.shape):
        if plan.pipeline is not None and mesh.pipeline_axis is None and plan.mesh.size == mesh.size:
            raise PlanMismatchError(
                f"the plan factors the mesh {dict(zip(mesh.axis_names, mesh.shape))} into "
                f"{dict(zip(plan.mesh.axis_names, plan.mesh.shape))} for its pipeline stages "
                f"(Config(pipeline='auto')): build that mesh from the same ranks, init_device_mesh(device, "
                f"{tuple(plan.mesh.shape)}, mesh_dim_names={tuple(plan.mesh.axis_names)}), and pass it to "
                "parallelize with plan=")
        raise PlanMismatchError(f"the plan is for mesh {dict(zip(plan.mesh.axis_names, plan.mesh.shape))}, "
                                f"parallelize got {dict(zip(mesh.axis_names, mesh.shape))}; re-plan for this mesh")
    here = ctx.precision.name
    if plan.mixed_precision is not None and plan.mixed_precision != here:
        raise PlanMismatchError(f"the plan was made for mixed_precision={plan.mixed_precision!r}, this run resolves "
                                f"Config(mixed_precision={ctx.config.mixed_precision!r}) on a {mesh.device_type} mesh "
                                f"to {here!r}; pass Config(mixed_precision={plan.mixed_precision!r}) or re-plan")
    if plan.microbatches != ctx.microbatches:
        raise PlanMismatchError(f"the plan splits each batch into {plan.microbatches} microbatches, this capture "
                                f"traced {ctx.microbatches}; capture with microbatches={plan.microbatches}")
    stacks = {b.prefix for b in ctx.captured.blocks}
    unknown = [p for p in plan.recompute if p not in stacks]
    if unknown:
        raise PlanMismatchError(f"the plan recomputes the layer stack {unknown[0]!r}, which this model lacks (its "
                                f"stacks: {', '.join(sorted(stacks)) or 'none'}); re-plan with this model")
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
