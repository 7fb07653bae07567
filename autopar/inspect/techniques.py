"""The parallelism techniques a Plan amounts to (dp, fsdp, tp, sp, cp, pp, ep, fp8, ac), read from its placements
and its recomputation (ac: activation checkpointing, some layer stack recomputes its activations)."""
from __future__ import annotations

from typing import Any

from torch.distributed.tensor import Replicate, Shard

from autopar.inspect.fmt import fp8_nodes, node_module, param_weight, pipeline_info

TECHNIQUES = ("dp", "fsdp", "tp", "sp", "cp", "pp", "ep", "fp8", "ac")
# A parameter share below this fraction of the model does not make an axis "data parallel" or "tensor
# parallel": the solver may shard or replicate tiny tensors (norm weights) either way at no cost.
_SIGNIFICANT = 0.05


# Forward matmuls: (activation operand, weight operand) positions among the tensor inputs.
_MATMULS = {"mm": (0, 1), "matmul": (0, 1), "linear": (0, 1), "addmm": (1, 2)}


def batch_axes(plan: Any) -> set[int]:
    """Mesh axes over which some input is split along its batch dim (dim 0)."""
    return {a for lay in plan.inputs if lay is not None for a, p in enumerate(lay) if isinstance(p, Shard)
            and p.dim == 0}


def _op_name(op: str) -> str:
    return op.removeprefix("aten.").split(".")[0]


def _param_shares(plan: Any, axis: int) -> tuple[float, float]:
    """(sharded, replicated) fractions of all parameter elements on one mesh axis."""
    total = sharded = 0.0
    for key, lay in plan.params.items():
        w = param_weight(plan, key)
        total += w
        if isinstance(lay[axis], Shard):
            sharded += w
    return (sharded / total, 1 - sharded / total) if total else (0.0, 0.0)


def matmul_roles(plan: Any) -> dict[tuple[int, str], float]:
    """{(axis, role): share of all parameter elements} from how each forward matmul runs on each axis: on a
    weight shard ("tp"), or on a batch shard with the weight stored replicated ("dp") or stored sharded and
    gathered for use ("fsdp"). A matmul is tied to its weight by module name (`<module>/fwd/mm`)."""
    total = sum(param_weight(plan, k) for k in plan.params) or 1.0
    roles: dict[tuple[int, str], float] = {}
    for key, n in plan.nodes.items():
        pos = _MATMULS.get(_op_name(n.op))
        pkey = f"{node_module(key)}.weight"
        if "/fwd/" not in key or pos is None or pkey not in plan.params or max(pos) >= len(n.ins):
            continue
        act, weight = n.ins[pos[0]], n.ins[pos[1]]
        if act is None or weight is None:
            continue
        share = param_weight(plan, pkey) / total
        for a, size in enumerate(plan.mesh.shape):
            if size == 1:
                continue
            if not isinstance(weight[a], Replicate):
                role = "tp"
            elif isinstance(act[a], Shard) and act[a].dim == 0:
                role = "fsdp" if isinstance(plan.params[pkey][a], Shard) else "dp"
            else:
                continue
            roles[(a, role)] = roles.get((a, role), 0.0) + share
    return roles


def tensor_axes(plan: Any) -> set[int]:
    """Axes that split parameters without splitting the batch, or on which matmuls run on weight shards."""
    batch = batch_axes(plan)
    by_params = {a for a in range(len(plan.mesh.shape)) if a not in batch and plan.mesh.shape[a] > 1
                 and _param_shares(plan, a)[0] >= _SIGNIFICANT}
    return by_params | {a for (a, role), share in matmul_roles(plan).items() if role == "tp" and share >= _SIGNIFICANT}


def _sequence_parallel(plan: Any, tp: set[int]) -> bool:
    # Norms and the residual adds between sublayers run on (batch, seq, dim) activations; sharding them on
    # dim 1 over a tensor axis is Megatron's sequence parallelism. Attention internals (heads on dim 1) are not.
    block_roots = {f"{p}.*" for p in plan.blocks}
    for key, n in plan.nodes.items():
        mod = node_module(key)
        if "/fwd/" not in key or not n.outs:
            continue
        norm_like = "norm" in mod.rsplit(".", 1)[-1] or (mod in block_roots and "add" in n.op)
        if norm_like and any(isinstance(n.outs[0][a], Shard) and n.outs[0][a].dim == 1 for a in tp
                             if a < len(n.outs[0])):
            return True
    return False


def _context_parallel(plan: Any) -> bool:
    # Attention with queries split on the sequence dim (dim 2 of (batch, heads, seq, head_dim)).
    for n in plan.nodes.values():
        if "attention" in n.op and n.ins and n.ins[0] is not None:
            if any(isinstance(p, Shard) and p.dim == 2 for p in n.ins[0]):
                return True
    return False


def techniques(plan: Any) -> frozenset[str]:
    """The parallelism techniques a plan amounts to, named as people name them (see TECHNIQUES)."""
    # Two readings, united: how inputs and stored parameters are split (an axis splitting the batch is data
    # parallel, fully sharded when it also splits parameters), and how each matmul actually runs, which also
    # catches plans that give one axis different roles in different layers.
    found = {role for (_, role), share in matmul_roles(plan).items() if share >= _SIGNIFICANT}
    for a in batch_axes(plan):
        if plan.mesh.shape[a] == 1:
            continue
        sharded, replicated = _param_shares(plan, a)
        if replicated >= _SIGNIFICANT:
            found.add("dp")
        if sharded >= _SIGNIFICANT:
            found.add("fsdp")
    tp = tensor_axes(plan)
    if tp:
        found.add("tp")
        if _sequence_parallel(plan, tp):
            found.add("sp")
    if _context_parallel(plan):
        found.add("cp")
    if pipeline_info(plan):
        found.add("pp")
    if any("expert" in k and any(isinstance(p, Shard) and p.dim == 0 for p in lay) for k, lay in plan.params.items()):
        found.add("ep")
    if fp8_nodes(plan):
        found.add("fp8")
    if any(d.get("variant", "keep") != "keep" or d.get("model_layers")
           for d in (getattr(plan, "recompute", None) or {}).values()):
        found.add("ac")
    return frozenset(found)


def techniques_text(plan: Any) -> str:
    t = techniques(plan)
    return ", ".join(x for x in TECHNIQUES if x in t) or "none (single-device layout)"
