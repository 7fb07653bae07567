"""Per-rank program generation: a Plan and the captured joint graph become one rank's Program, local forward
and backward graphs with explicit functional collectives and local shapes."""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate

from autopar.capture import Captured
from autopar.codegen.builder import CodegenError, RankSpec
from autopar.codegen.collectives import BUCKET_META, VALUE_META, collective_group, collective_kind
from autopar.codegen.lower import LocalJoint, lower
from autopar.codegen.partition import split
from autopar.plan import Plan
from autopar.program import Collective, Program, TensorSpec


def generate_stages(plan: Plan, cap: Captured, rank: RankSpec, stages: list[int] | None = None) -> list[Program]:
    """A pipelined plan's stage Programs (autopar/codegen/stages.py): those of `stages`, by default the ones
    this rank's pipeline coordinate runs."""
    from autopar.codegen.stages import cut_stages

    pp = plan.pipeline
    if stages is None:
        axis = plan.mesh.axis_names.index(pp.axis)
        stages = [s for s, r in enumerate(pp.stage_ranks) if r == rank.coords[axis]]
    from autopar.codegen.split_backward import split_backward
    from autopar.cost.pipeline import splits_backward

    cuts = cut_stages(cap, plan)
    programs = [generate(cuts[s].plan, cuts[s].captured, rank, stage=s) for s in stages]
    for prog in programs:  # zero-bubble schedules run input gradients first, weight gradients later
        if splits_backward(pp.schedule) and prog.activations_in:
            prog.backward_input, prog.backward_weight = split_backward(prog.backward, len(prog.params))
    return programs


def generate(plan: Plan, cap: Captured, rank: RankSpec, stage: int | None = None) -> Program:
    """Lower `cap` under `plan` for one rank and split it into forward and backward graphs."""
    joint = lower(plan, cap, rank)
    parts = split(joint)

    def spec(name: str, node: fx.Node, local: fx.Node, leaf: int | None = None) -> TensorSpec:
        val = node.meta["val"]
        return TensorSpec(name, tuple(int(s) for s in val.shape), tuple(int(s) for s in local.meta["val"].shape),
                          val.dtype, tuple(joint.layouts[local.name]), leaf)

    params = [spec(f, cap.params[f], joint.params[f]) for f in cap.params]
    buffers = [spec(f, cap.buffers[f], joint.buffers[f]) for f in cap.buffers]
    inputs = [spec(cap.names[n], n, local, int(getattr(n.meta.get("desc"), "idx", i)))
              for i, (n, local) in enumerate(zip(cap.inputs, joint.inputs))]
    forward_only = not any(g is not None for g in cap.grads.values())
    fwd_out = next(n for n in parts.forward.graph.nodes if n.op == "output").args[0]
    out_locals = fwd_out[joint.n_heads + len(joint.updates):]
    acts_in = [TensorSpec(cap.names[n], tuple(int(x) for x in n.meta["val"].shape),
                          tuple(int(x) for x in local.meta["val"].shape), n.meta["val"].dtype,
                          tuple(joint.layouts[local.name])) for n, local in zip(cap.stage_inputs, joint.stage_inputs)]
    acts_out = [TensorSpec(cap.names[n], tuple(int(x) for x in n.meta["val"].shape),
                           tuple(int(x) for x in local.meta["val"].shape), n.meta["val"].dtype,
                           (Replicate(),) * len(rank.axis_sizes) if cap.replicated_heads else
                           tuple(_layout_of(plan, cap, n))) for n, local in zip(cap.stage_outputs, fwd_out)]
    outputs = [TensorSpec(cap.names[n], tuple(int(s) for s in n.meta["val"].shape),
                          tuple(int(s) for s in local.meta["val"].shape), n.meta["val"].dtype,
                          tuple(_layout_of(plan, cap, n)))
               for n, local in zip(cap.outputs, out_locals)]
    sync = joint.grad_sync
    return Program(plan=plan, rank=rank, forward=parts.forward, backward=parts.backward, params=params,
                   buffers=buffers, inputs=inputs, saved=parts.saved, recomputed=parts.recomputed,
                   collectives=[*program_collectives(parts.forward, "forward", rank),
                                *program_collectives(parts.backward, "backward", rank),
                                *(program_collectives(sync, "grad_sync", rank) if sync is not None else [])],
                   buffer_updates=list(joint.updates), outputs=outputs,
                   takes_seed=joint.rng_seed is not None, forward_only=forward_only, joint=joint,
                   microbatches=plan.microbatches, grad_sync=sync, synced=list(joint.synced),
                   loss_reduction=cap.loss_reduction, returns_count=joint.count, stage=stage,
                   activations_in=acts_in, activations_out=acts_out)


def functional(program: Program) -> Program:
    """The same program with functional graphs only (no in-place collective), the form compilers take
    (`torch.compile(functional(prog).backward)`, as `parallelize(compile=True)` does). Its forward takes the
    step seed as a 0-d int64 tensor."""
    from autopar.codegen import schedule

    sync = schedule.functional(program.grad_sync) if program.grad_sync is not None else None
    return dataclasses.replace(program, forward=schedule.functional(program.forward),
                               backward=schedule.functional(program.backward), grad_sync=sync,
                               seed_as_tensor=program.takes_seed)


def _layout_of(plan: Plan, cap: Captured, node: fx.Node) -> tuple:
    """The planned layout of a value (an output of its producer, looking through tuple getitem)."""
    import operator

    idx = 0
    if node.op == "call_function" and node.target is operator.getitem:
        node, idx = node.args[0], int(node.args[1])
    name = cap.names[node]
    return (plan.nodes.get(name) or plan.nodes[plan.key(name)]).outs[idx]


def program_collectives(gm: fx.GraphModule, graph: str, rank: RankSpec) -> list[Collective]:
    """The collectives of one generated graph in issue order."""
    out = []
    for n in gm.graph.nodes:
        kind = collective_kind(n)
        if kind is None:
            continue
        group = collective_group(n)
        val = n.args[0].meta.get("val") if isinstance(n.args[0], fx.Node) else None
        shape = tuple(int(s) for s in val.shape) if isinstance(val, torch.Tensor) else ()
        dtype = val.dtype if isinstance(val, torch.Tensor) else torch.float32
        out.append(Collective(graph, n.name, kind, rank.axis_of_group(group), group, shape, dtype,
                              tuple(n.meta.get(BUCKET_META, ())), n.meta.get(VALUE_META, "")))
    return out


def collectives(gm, rank: RankSpec | None = None) -> list[tuple[str, str]]:
    """(kind, axis or group name) of every functional collective in a generated graph (or a list of its
    nodes), in program order."""
    out = []
    for n in (gm.graph.nodes if hasattr(gm, "graph") else gm):
        kind = collective_kind(n)
        if kind is not None:
            g = collective_group(n)
            out.append((kind, rank.axis_of_group(g) if rank is not None else g))
    return out


__all__ = ["CodegenError", "RankSpec", "LocalJoint", "Program", "generate", "generate_stages", "lower", "split",
           "collectives", "functional"]
