"""Human-readable views of a Plan: the full table, a short summary, and the techniques it amounts to.

Everything here reads only the serialized Plan fields, so a plan loaded from JSON prints the same as a fresh
one; `explain` and `diff` live in autopar.inspect_explain and are re-exported here.
"""
from __future__ import annotations

from typing import Any

from rich import box
from rich.table import Table
from rich.text import Text
from torch.distributed.tensor import Replicate, Shard

from autopar.inspect_explain import diff, explain
from autopar.inspect_fmt import (TOP_LEVEL, axis_layout, block_of, comm_entries, fmt_bytes, fmt_count, fmt_time,
                                 fp8_nodes, group_params, group_transitions, instances, memory_items, mesh_text,
                                 node_module, param_weight, pipeline_info, r6, render, shard_factor, top_nodes)

__all__ = ["format_plan", "format_summary", "explain", "diff", "techniques", "TECHNIQUES"]

TECHNIQUES = ("dp", "fsdp", "tp", "sp", "cp", "pp", "ep", "fp8")
# A parameter share below this fraction of the model does not make an axis "data parallel" or "tensor
# parallel": the solver may shard or replicate tiny tensors (norm weights) either way at no cost.
_SIGNIFICANT = 0.05
_MAX_COLLECTIVES = 12


# --- techniques ---------------------------------------------------------------------------------------------

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
    return frozenset(found)


def techniques_text(plan: Any) -> str:
    t = techniques(plan)
    return ", ".join(x for x in TECHNIQUES if x in t) or "none (single-device layout)"


# --- the full table -----------------------------------------------------------------------------------------

def _header(plan: Any) -> Table:
    cb = plan.cost_breakdown
    g = Table.grid(padding=(0, 2))
    g.add_column(style="bold")
    g.add_column()
    g.add_row("mesh", mesh_text(plan))
    g.add_row("device", plan.device)
    g.add_row("step time", f"{fmt_time(plan.estimated_step_time)}  (compute {fmt_time(cb.get('compute_s'))}, "
                           f"exposed comm {fmt_time(cb.get('exposed_comm_s'))}, "
                           f"optimizer {fmt_time(cb.get('optimizer_s'))})")
    g.add_row("peak memory", _memory_text(plan))
    g.add_row("techniques", techniques_text(plan))
    if plan.inputs:
        g.add_row("inputs", "; ".join(f"#{i} {axis_layout(plan.mesh.axis_names, lay)}"
                                      for i, lay in enumerate(plan.inputs)))
    if plan.solver_stats.get("recipe"):
        note = plan.solver_stats.get("recipe_note")
        g.add_row("recipe", plan.solver_stats["recipe"] + (f" ({note})" if note else ""))
    solver = _solver_text(plan)
    if solver:
        g.add_row("solver", solver)
    return g


def _memory_text(plan: Any) -> str:
    peak = plan.peak_memory_per_rank
    if not plan.memory_limit:
        return f"{fmt_bytes(peak)} per rank"
    pct = peak / plan.memory_limit * 100
    verdict = "fits" if peak <= plan.memory_limit else "DOES NOT FIT"
    return f"{fmt_bytes(peak)} per rank of {fmt_bytes(plan.memory_limit)} ({pct:.0f}%, {verdict})"


def _solver_text(plan: Any) -> str:
    s = plan.solver_stats
    parts = []
    if "optimal" in s:
        parts.append(gap_text(plan))
    for k, label in (("keys", "decisions"), ("variables", "variables")):
        if k in s:
            parts.append(f"{s[k]} {label}")
    if s.get("memory_binds"):
        parts.append("memory limit binds")
    return ", ".join(parts)


def gap_text(plan: Any) -> str:
    """How far from optimal the plan may be: 'optimal', or its proven gap and the bound on the step time."""
    s = plan.solver_stats
    if s.get("optimal") or "gap" not in s:
        return "optimal" if s.get("optimal") else "best found (no bound)"
    return (f"within {s['gap']:.1%} of optimal (the program's step time {fmt_time(s['objective_s'])}, "
            f"bound {fmt_time(s['bound_s'])})")


def params_table(plan: Any) -> Table:
    names = plan.mesh.axis_names
    total = sum(param_weight(plan, k) for k in plan.params)
    tensors = sum(instances(plan, k) for k in plan.params)
    t = Table(title=f"Parameters ({tensors} tensors, {fmt_count(total)} elements)",
              box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False)
    t.add_column("parameter")
    t.add_column("numel", justify="right")
    t.add_column("placement")
    t.add_column("per rank", justify="right")
    for i, (title, rows) in enumerate(group_params(plan).items()):
        if i:
            t.add_section()
        t.add_row(Text(title, style="bold"), "", "", "")
        for name, key in sorted(rows, key=lambda r: r[0]):
            lay = plan.params[key]
            numel = plan.param_numel.get(key)
            local = numel / shard_factor(lay, plan.mesh.shape) if numel is not None else None
            t.add_row(f"  {name}", fmt_count(numel), axis_layout(names, lay), fmt_count(local))
    return t


def collectives_table(plan: Any, limit: int = _MAX_COLLECTIVES) -> Table | Text:
    groups = group_transitions(plan)
    if not groups:
        return Text("Collectives: none (every tensor is already where its consumers need it)")
    total = sum(g["time_s"] for g in groups)
    t = Table(title=f"Main collectives: {fmt_time(total)} in total (before overlap with compute)",
              box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False)
    t.add_column("collective")
    t.add_column("on")
    t.add_column("edges", justify="right")
    t.add_column("time", justify="right")
    t.add_column("example")
    for g in groups[:limit]:
        ex = g["example"]
        t.add_row(g["steps"], g["kind"], str(g["edges"]), fmt_time(g["time_s"]), _edge_text(ex))
    rest = groups[limit:]
    if rest:
        t.add_row(f"... {len(rest)} more", "", str(sum(g["edges"] for g in rest)),
                  fmt_time(sum(g["time_s"] for g in rest)), "")
    return t


def _edge_text(t: Any) -> str:
    if t.kind == "grad":
        return f"grad of {t.dst.split('/', 1)[-1]}"
    return f"{t.src} -> {t.dst}"


def breakdown_tables(plan: Any) -> Table:
    cost = Table(title="Time per step", box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False)
    cost.add_column("component")
    cost.add_column("time", justify="right")
    cb = plan.cost_breakdown
    for k, label in (("compute_s", "compute"), ("comm_s", "communication"), ("exposed_comm_s", "  not overlapped"),
                     ("optimizer_s", "optimizer")):
        if k in cb:
            cost.add_row(label, fmt_time(cb[k]))
    for (axis, kind), v in sorted(comm_entries(cb).items(), key=lambda kv: (-r6(kv[1]), kv[0])):
        cost.add_row(f"  {kind} over {axis}", fmt_time(v))
    cost.add_row(Text("step", style="bold"), Text(fmt_time(plan.estimated_step_time), style="bold"))
    mem = Table(title="Memory per rank", box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False)
    mem.add_column("component")
    mem.add_column("bytes", justify="right")
    for k, v in memory_items(plan):
        if v:
            mem.add_row(k.replace("_", " "), fmt_bytes(v))
    mem.add_row(Text("peak", style="bold"), Text(fmt_bytes(plan.peak_memory_per_rank), style="bold"))
    if plan.memory_limit:
        mem.add_row("limit", fmt_bytes(plan.memory_limit))
    g = Table.grid(padding=(0, 6))
    g.add_row(cost, mem)
    return g


def top_ops_table(plan: Any, limit: int = 8) -> Table:
    t = Table(title="Largest compute", box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False)
    t.add_column("node")
    t.add_column("op")
    t.add_column("x", justify="right")
    t.add_column("time", justify="right")
    t.add_column("output")
    for key, n in top_nodes(plan, limit):
        out = axis_layout(plan.mesh.axis_names, n.outs[0]) if n.outs else "-"
        t.add_row(key, n.op.removeprefix("aten."), f"{n.count:g}", fmt_time(n.compute_s), out)
    return t


def format_plan(plan: Any, width: int = 110, color: bool = False) -> str:
    """The whole plan as a readable text table: header, parameter placements by block, collectives, costs."""
    parts = [Text("autopar plan", style="bold underline"), _header(plan), Text(""), params_table(plan),
             collectives_table(plan), top_ops_table(plan), breakdown_tables(plan)]
    return render(parts, width=width, color=color)


def format_summary(plan: Any) -> str:
    """A few lines: mesh, step time, memory, techniques, and the placement of each kind of parameter."""
    precision = {"bf16": ", bf16 compute (fp32 master weights)", "fp32": ", fp32"}.get(plan.mixed_precision, "")
    lines = [f"autopar plan on {mesh_text(plan)}, {plan.device}{precision}",
             f"  step {fmt_time(plan.estimated_step_time)} (compute "
             f"{fmt_time(plan.cost_breakdown.get('compute_s'))}, exposed comm "
             f"{fmt_time(plan.cost_breakdown.get('exposed_comm_s'))}); peak memory {_memory_text(plan)}",
             f"  techniques: {techniques_text(plan)}"]
    if "optimal" in plan.solver_stats:
        lines.append(f"  solver: {gap_text(plan)}")
    patterns: dict[str, list[str]] = {}
    for key, lay in sorted(plan.params.items()):
        patterns.setdefault(axis_layout(plan.mesh.axis_names, lay), []).append(key)
    for lay, keys in sorted(patterns.items(), key=lambda kv: (-sum(param_weight(plan, k) for k in kv[1]), kv[0])):
        shown = ", ".join(_short(k, plan) for k in keys[:4]) + (f", +{len(keys) - 4} more" if len(keys) > 4 else "")
        lines.append(f"  {lay}: {shown}")
    return "\n".join(lines) + "\n"


def _short(key: str, plan: Any) -> str:
    b = block_of(plan, key)
    name = key[len(b[0]) + 3:] if b else key
    return name.removesuffix(".weight")


__all__ += ["batch_axes", "tensor_axes", "matmul_roles", "techniques_text", "TOP_LEVEL"]
