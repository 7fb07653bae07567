"""Shared helpers of plan inspection: units, layout phrasing, parameter grouping and plain-text rendering."""
from __future__ import annotations

import io
import re
from typing import Any, Iterable, Sequence

from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from autopar.layout import fmt

COMM_KINDS = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all")
TOP_LEVEL = "(top level)"


def r6(x: float) -> float:
    """A float as the plan file stores it (6 significant digits): rank by this so loaded plans print the same."""
    return float(f"{x:.6g}")


def fmt_time(s: float | None) -> str:
    if s is None:
        return "-"
    a = abs(s)
    if a == 0:
        return "0"
    if a >= 1:
        return f"{s:.3g} s"
    if a >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    if a >= 1e-6:
        return f"{s * 1e6:.3g} us"
    return f"{s * 1e9:.3g} ns"


def fmt_bytes(b: float | None) -> str:
    if b is None:
        return "-"
    a = abs(b)
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if a >= scale:
            return f"{b / scale:.3g} {unit}"
    return f"{b:.0f} B"


def fmt_count(n: float | None) -> str:
    if n is None:
        return "-"
    a = abs(n)
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if a >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def signed(text: str, value: float) -> str:
    return text if value < 0 else f"+{text}"


def delta_time(a: float, b: float) -> str:
    # At the precision a plan file keeps (6 significant digits), so a loaded plan diffs as the one in memory.
    a, b = float(f"{a:.6g}"), float(f"{b:.6g}")
    d = b - a
    pct = f", {d / a * 100:+.1f}%" if a else ""
    return f"{fmt_time(a)} -> {fmt_time(b)} ({signed(fmt_time(d), d)}{pct})"


def delta_bytes(a: float, b: float) -> str:
    d = b - a
    pct = f", {d / a * 100:+.1f}%" if a else ""
    return f"{fmt_bytes(a)} -> {fmt_bytes(b)} ({signed(fmt_bytes(d), d)}{pct})"


def axis_layout(axis_names: Sequence[str], layout: Sequence[Placement] | None) -> str:
    """`dp=S(0) tp=R`: a layout with each placement named by its mesh axis."""
    if layout is None:
        return "-"
    return " ".join(f"{a}={fmt(p)}" for a, p in zip(axis_names, layout))


def describe_placement(p: Placement) -> str:
    if isinstance(p, Shard):
        return f"sharded on dim {p.dim}"
    if isinstance(p, Partial):
        return f"partial ({p.reduce_op})"
    return "replicated"


def shard_factor(layout: Sequence[Placement], shape: Sequence[int]) -> int:
    n = 1
    for p, s in zip(layout, shape):
        if isinstance(p, Shard):
            n *= s
    return n


def is_replicate(p: Placement) -> bool:
    return isinstance(p, Replicate)


def mesh_text(plan: Any) -> str:
    m = plan.mesh
    axes = " x ".join(f"{a}={n} ({link})" for a, n, link in zip(m.axis_names, m.shape, m.links))
    return f"{axes} = {m.size} ranks"


def block_of(plan: Any, key: str) -> tuple[str, int] | None:
    """(prefix, count) of the repeated layer stack a block-relative key lives in, else None."""
    for prefix, count in plan.blocks.items():
        if key.startswith(f"{prefix}.*.") or key.startswith(f"{prefix}.*/"):
            return prefix, count
    return None


def instances(plan: Any, key: str) -> int:
    b = block_of(plan, key)
    return b[1] if b else 1


def param_weight(plan: Any, key: str) -> float:
    """Elements of a parameter over the whole model (all layers of its block); 1 per tensor without numel."""
    return float(plan.param_numel.get(key, 1)) * instances(plan, key)


def group_params(plan: Any) -> dict[str, list[tuple[str, str]]]:
    """{group title: [(name within the group, plan key)]}: repeated blocks first, then top-level params."""
    groups: dict[str, list[tuple[str, str]]] = {}
    top: list[tuple[str, str]] = []
    for key in sorted(plan.params):  # sorted: a plan file stores params sorted, a fresh plan in graph order
        b = block_of(plan, key)
        if b is None:
            top.append((key, key))
        else:
            title = f"{b[0]}.* (x{b[1]})"
            groups.setdefault(title, []).append((key[len(b[0]) + 3:], key))
    if top:
        groups[TOP_LEVEL] = top
    return groups


def node_module(key: str) -> str:
    return key.split("/", 1)[0]


def comm_entries(cost_breakdown: dict[str, float]) -> dict[tuple[str, str], float]:
    """{(axis, collective): seconds} from the `comm[<axis>:<collective>]_s` entries of a cost breakdown."""
    out = {}
    for k, v in cost_breakdown.items():
        m = re.fullmatch(r"comm\[(.+?):(.+)\]_s", k)
        if m:
            out[(m.group(1), m.group(2))] = float(v)
    return out


def is_comm_steps(steps: str) -> bool:
    return any(k in steps for k in COMM_KINDS)


def group_transitions(plan: Any) -> list[dict]:
    """Transitions grouped by (kind, steps): edges, total seconds; sorted by time, collectives only."""
    groups: dict[tuple[str, str], dict] = {}
    for t in plan.transitions:
        if not is_comm_steps(t.steps):
            continue
        g = groups.setdefault((t.kind, t.steps), {"kind": t.kind, "steps": t.steps, "edges": 0, "count": 0.0,
                                                  "time_s": 0.0, "example": t})
        g["edges"] += 1
        g["count"] += t.count
        g["time_s"] += t.cost_s  # cost_s already covers every repetition of the edge
    return sorted(groups.values(), key=lambda g: (-r6(g["time_s"]), g["steps"], g["kind"]))


def fp8_nodes(plan: Any) -> list[str]:
    """Node keys whose chosen variant runs in FP8, sorted."""
    return sorted(key for key, n in plan.nodes.items()
                  if "fp8" in str(getattr(n, "variant", "") or "").lower() or "scaled_mm" in n.op)


def pipeline_info(plan: Any) -> dict | None:
    """The plan's pipeline description ({"stages": n, "schedule": ..., "timeline": [(stage, label, start, end)]}),
    or None when the plan has no pipeline stages."""
    info = getattr(plan, "pipeline", None) or plan.solver_stats.get("pipeline")
    if info is not None and not isinstance(info, dict):
        info = info.to_json()
    if isinstance(info, dict) and int(info.get("stages", 1) or 1) > 1:
        return info
    return None


MEMORY_ORDER = ("params", "buffers", "grads", "optimizer", "master_weights", "activations")


def memory_items(plan: Any) -> list[tuple[str, int]]:
    """The memory breakdown in a fixed order (a plan file stores it sorted by name)."""
    mb = plan.memory_breakdown
    return [(k, mb[k]) for k in MEMORY_ORDER if k in mb] + sorted((k, v) for k, v in mb.items()
                                                                  if k not in MEMORY_ORDER)


def top_nodes(plan: Any, n: int) -> list[tuple[str, Any]]:
    """The n nodes with the largest compute time (ties by key), skipping nodes that take no time."""
    ranked = sorted(plan.nodes.items(), key=lambda kv: (-r6(kv[1].compute_s), kv[0]))
    return [(k, v) for k, v in ranked[:n] if v.compute_s > 0]


def render(renderables: Iterable[Any], width: int = 100, color: bool = False) -> str:
    """Render rich objects to a string; plain text (no ANSI codes) unless `color`."""
    from rich.console import Console

    console = Console(record=True, width=width, file=io.StringIO(), force_terminal=color,
                      color_system="truecolor" if color else None, soft_wrap=False, highlight=False,
                      markup=False, emoji=False)
    for r in renderables:
        console.print(r)
    text = console.export_text(styles=color)
    return "\n".join(line.rstrip() for line in text.splitlines()) + "\n"
