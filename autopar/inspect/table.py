"""The plan as text: the full table (header, parameter placements by block, collectives, costs) and a summary.

Everything here reads only the serialized Plan fields, so a plan loaded from JSON prints the same as a fresh one.
"""
from __future__ import annotations

from typing import Any

from rich import box
from rich.table import Table
from rich.text import Text

from autopar.inspect.fmt import (axis_layout, block_of, comm_entries, fmt_bytes, fmt_count, fmt_time,
                                 group_params, group_transitions, instances, memory_items, mesh_text,
                                 param_weight, r6, render, shard_factor, top_nodes)
from autopar.inspect.fp8 import fp8_line, fp8_table
from autopar.inspect.recompute import recompute_line
from autopar.inspect.techniques import techniques_text

_MAX_COLLECTIVES = 12

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
    fp8 = fp8_line(plan)
    if fp8:
        g.add_row("fp8", fp8)
    if recompute_line(plan):
        g.add_row("recompute", recompute_line(plan))
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
             collectives_table(plan), top_ops_table(plan)]
    parts += [t for t in (fp8_table(plan),) if t is not None]
    parts.append(breakdown_tables(plan))
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
    if fp8_line(plan):
        lines.append(f"  fp8: {fp8_line(plan)}")
    if recompute_line(plan):
        lines.append(f"  recompute: {recompute_line(plan)}")
    lines.extend(_pipeline_lines(plan))
    if plan.batch_norms:
        kinds: dict[str, int] = {}
        for how in plan.batch_norms.values():
            kinds[how] = kinds.get(how, 0) + 1
        lines.append("  batch norm statistics: " + ", ".join(f"{n} {how}" for how, n in sorted(kinds.items())))
    patterns: dict[str, list[str]] = {}
    for key, lay in sorted(plan.params.items()):
        patterns.setdefault(axis_layout(plan.mesh.axis_names, lay), []).append(key)
    for lay, keys in sorted(patterns.items(), key=lambda kv: (-sum(param_weight(plan, k) for k in kv[1]), kv[0])):
        shown = ", ".join(_short(k, plan) for k in keys[:4]) + (f", +{len(keys) - 4} more" if len(keys) > 4 else "")
        lines.append(f"  {lay}: {shown}")
    return "\n".join(lines) + "\n"


def _pipeline_lines(plan: Any) -> list[str]:
    pp = getattr(plan, "pipeline", None)
    m = getattr(plan, "microbatches", 1)
    if pp is None:
        return [f"  microbatches: {m} per step, gradients reduced once"] if m > 1 else []
    per = f", {pp.virtual_stages} per rank" if pp.virtual_stages > 1 else ""
    stages = " | ".join(_span(mods) for mods in pp.stage_modules)
    return [f"  pipeline: {pp.stages} stages over {pp.axis}={pp.ranks}{per}, {pp.schedule}, {pp.microbatches} "
            f"microbatches, bubble {pp.bubble_fraction:.0%}",
            f"  stages: {stages}"]


def _span(modules: list[str]) -> str:
    """Module names of one stage, its run of layers shortened to the first and last (`layers.0..7`)."""
    layers = [m for m in modules if m.rsplit(".", 1)[-1].isdigit()]
    if len(layers) < 2:
        return ", ".join(modules)
    run = f"{layers[0]}..{layers[-1].rsplit('.', 1)[-1]}"
    before = [m for m in modules[:modules.index(layers[0])]]
    after = [m for m in modules[modules.index(layers[-1]) + 1:]]
    return ", ".join([*before, run, *after])


def _short(key: str, plan: Any) -> str:
    b = block_of(plan, key)
    name = key[len(b[0]) + 3:] if b else key
    return name.removesuffix(".weight")

