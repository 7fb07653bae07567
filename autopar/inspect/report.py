"""A self-contained HTML report of a Plan, its plots embedded as base64 PNG (optionally also written as files).

Plots draw on matplotlib `Figure` objects directly (Agg rendering, no pyplot), so writing a report never
changes the caller's matplotlib backend or global state.
"""
from __future__ import annotations

import base64
import html
import io
import os
from typing import Any

from matplotlib.figure import Figure
from torch.distributed.tensor import Partial, Shard

from autopar.inspect.fmt import (comm_entries, fmt_bytes, fmt_count, fmt_time, fp8_nodes, group_params,
                                 group_transitions, memory_items, mesh_text, pipeline_info, top_nodes)
from autopar.inspect.table import format_plan
from autopar.inspect.recompute import recompute_line
from autopar.inspect.techniques import techniques_text
from autopar.layout import fmt

_COLORS = {"R": "#d9d9d9", "P": "#c44e52", 0: "#4c72b0", 1: "#55a868", 2: "#8172b2", 3: "#64b5cd"}
_MEM_COLORS = {"params": "#4c72b0", "buffers": "#937860", "grads": "#55a868", "optimizer": "#c44e52",
               "master_weights": "#8172b2", "activations": "#dd8452"}
_TOP_OPS = 15


def time_unit(max_s: float) -> tuple[float, str]:
    """(multiplier, label) that puts `max_s` seconds in a readable range."""
    if max_s >= 1:
        return 1.0, "s"
    return (1e3, "ms") if max_s >= 1e-3 else (1e6, "us")


def placement_color(p: Any) -> str:
    if isinstance(p, Shard):
        return _COLORS.get(p.dim, _COLORS[3])
    if isinstance(p, Partial):
        return _COLORS["P"]
    return _COLORS["R"]


# --- figures ----------------------------------------------------------------------------------------------------

def placement_figure(plan: Any) -> Figure:
    """One heatmap-style table per block: parameters down, mesh axes across, colored R / S(dim) / P."""
    groups = group_params(plan)
    axes_n = len(plan.mesh.axis_names)
    heights = [max(1, len(rows)) for rows in groups.values()]
    longest = max((len(n) for rows in groups.values() for n, _ in rows), default=10)
    fig = Figure(figsize=(2.2 + 0.075 * longest + 1.1 * axes_n, 0.9 + 0.28 * sum(heights) + 0.5 * len(groups)))
    axs = fig.subplots(len(groups), 1, squeeze=False, gridspec_kw={"height_ratios": heights})[:, 0]
    for ax, (title, rows) in zip(axs, groups.items()):
        rows = sorted(rows)
        for i, (_, key) in enumerate(rows):
            for j, p in enumerate(plan.params[key]):
                ax.add_patch(_rect(j, i, placement_color(p)))
                ax.text(j + 0.5, i + 0.5, fmt(p), ha="center", va="center", fontsize=8)
        ax.set_xlim(0, axes_n)
        ax.set_ylim(len(rows), 0)
        ax.set_xticks([j + 0.5 for j in range(axes_n)], [f"{a} ({n})" for a, n in
                                                          zip(plan.mesh.axis_names, plan.mesh.shape)])
        ax.xaxis.tick_top()
        ax.set_yticks([i + 0.5 for i in range(len(rows))], [n for n, _ in rows], fontsize=8)
        ax.set_title(title, fontsize=9, loc="left", pad=18)
        for s in ax.spines.values():
            s.set_visible(False)
        ax.tick_params(length=0)
    fig.tight_layout()
    return fig


def _rect(x: float, y: float, color: str):
    from matplotlib.patches import Rectangle

    return Rectangle((x + 0.03, y + 0.05), 0.94, 0.9, color=color)


def memory_figure(plan: Any) -> Figure:
    """Stacked per-rank memory (every rank holds the same under SPMD) against the limit."""
    fig = Figure(figsize=(8, 2.4))
    ax = fig.subplots()
    left = 0.0
    scale, unit = (2**30, "GiB") if max(plan.peak_memory_per_rank, plan.memory_limit or 0) >= 2**30 else (2**20, "MiB")
    for k, v in memory_items(plan):
        if v:
            ax.barh(["per rank"], [v / scale], left=left, color=_MEM_COLORS.get(k, "#999999"),
                    label=f"{k.replace('_', ' ')} {fmt_bytes(v)}")
            left += v / scale
    peak = plan.peak_memory_per_rank / scale
    limit = plan.memory_limit / scale if plan.memory_limit else None
    if limit and limit <= 3 * max(peak, 1e-9):
        ax.axvline(limit, color="black", linestyle="--", label=f"limit {fmt_bytes(plan.memory_limit)}")
        ax.set_xlim(0, max(limit, peak) * 1.1)
    elif limit:
        ax.set_title(f"limit {fmt_bytes(plan.memory_limit)} per rank (off this scale)", fontsize=9, loc="right")
    ax.set_xlabel(f"{unit} per rank")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=3, frameon=False)
    fig.tight_layout()
    return fig


def comm_figure(plan: Any) -> Figure | None:
    """Collective time per mesh axis, stacked by collective kind, and bytes per axis."""
    entries = comm_entries(plan.cost_breakdown)
    if not entries:
        return None
    volume = plan.comm_bytes
    fig = Figure(figsize=(9 if volume else 6, 3))
    axs = fig.subplots(1, 2 if volume else 1, squeeze=False)[0]
    axes = list(plan.mesh.axis_names)
    kinds = sorted({k for _, k in entries})
    bottom = [0.0] * len(axes)
    palette = ["#4c72b0", "#55a868", "#c44e52", "#8172b2", "#dd8452"]
    scale, unit = time_unit(max(sum(v for (a, _), v in entries.items() if a == x) for x in axes))
    for i, kind in enumerate(kinds):
        vals = [entries.get((a, kind), 0.0) * scale for a in axes]
        axs[0].bar(axes, vals, bottom=bottom, color=palette[i % len(palette)], label=kind)
        bottom = [b + v for b, v in zip(bottom, vals)]
    axs[0].set_ylabel(f"{unit} per step")
    axs[0].set_title("collective time per axis", fontsize=9)
    axs[0].legend(fontsize=8)
    if volume:
        axs[1].bar(axes, [volume.get(a, 0.0) / 2**20 for a in axes], color="#64b5cd")
        axs[1].set_ylabel("MiB per rank per step")
        axs[1].set_title("communication volume per axis", fontsize=9)
    fig.tight_layout()
    return fig


def top_ops_figure(plan: Any, n: int = _TOP_OPS) -> Figure | None:
    ranked = top_nodes(plan, n)
    if not ranked:
        return None
    fig = Figure(figsize=(9, 0.8 + 0.3 * len(ranked)))
    ax = fig.subplots()
    labels = [_trim(k, 60) for k, _ in ranked]
    scale, unit = time_unit(ranked[0][1].compute_s)
    ax.barh(labels[::-1], [v.compute_s * scale for _, v in ranked][::-1], color="#4c72b0")
    ax.set_xlabel(f"{unit} per step (all layers)")
    ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    return fig


def _trim(s: str, n: int) -> str:
    return s if len(s) <= n else "..." + s[-(n - 3):]


def timeline_figure(timeline: list, title: str, lanes: list[str] | None = None) -> Figure | None:
    """Gantt chart of (lane, label, start_s, end_s) records."""
    if not timeline:
        return None
    seen = sorted({str(r[0]) for r in timeline}, key=lambda x: (x != "compute", x))
    lanes = list(lanes or []) + [x for x in seen if x not in (lanes or [])]
    fig = Figure(figsize=(11, 0.9 + 0.45 * len(lanes)))
    ax = fig.subplots()
    scale, unit = time_unit(max(r[3] for r in timeline))
    for i, lane in enumerate(lanes):
        spans = [(r[2] * scale, (r[3] - r[2]) * scale) for r in timeline if str(r[0]) == lane]
        color = "#4c72b0" if lane == "compute" else "#c44e52" if lane.startswith("comm") else _COLORS[i % 4]
        ax.broken_barh(spans, (i - 0.4, 0.8), color=color)
    return _lanes_figure(fig, ax, lanes, unit, title)


def _lanes_figure(fig: Figure, ax, lanes: list, unit: str, title: str) -> Figure:
    """Finish a chart of one horizontal lane per entry of `lanes`, the first on top."""
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_ylim(len(lanes) - 0.5, -0.5)
    ax.set_xlabel(unit)
    ax.set_title(title, fontsize=9, loc="left")
    fig.tight_layout()
    return fig


# --- HTML -----------------------------------------------------------------------------------------------------

def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    return buf.getvalue()


def _img(png: bytes, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'


def _table(header: list[str], rows: list[list[str]], cls: str = "") -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f'<table class="{cls}"><tr>{head}</tr>{body}</table>'


def _placement_html(plan: Any) -> str:
    names = plan.mesh.axis_names
    head = "".join(f"<th>{html.escape(a)}</th>" for a in names)
    out = [f'<table class="placement"><tr><th>parameter</th><th>numel</th>{head}</tr>']
    for title, rows in group_params(plan).items():
        out.append(f'<tr class="group"><td colspan="{2 + len(names)}">{html.escape(title)}</td></tr>')
        for name, key in sorted(rows):
            cells = "".join(f'<td style="background:{placement_color(p)}">{fmt(p)}</td>' for p in plan.params[key])
            out.append(f'<tr class="param-row" data-key="{html.escape(key)}"><td>{html.escape(name)}</td>'
                       f"<td>{fmt_count(plan.param_numel.get(key))}</td>{cells}</tr>")
    out.append("</table>")
    return "".join(out)


_CSS = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;color:#222}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:2px 8px;font-size:13px}
th{background:#f3f3f3}tr.group td{font-weight:bold;background:#fafafa}img{max-width:100%}
pre{background:#f7f7f7;padding:1em;overflow-x:auto;font-size:12px}.none{color:#666;font-style:italic}"""


def build_sections(plan: Any) -> list[tuple[str, str, list[tuple[str, Figure | None]]]]:
    """[(section title, html, [(figure name, figure)])] in report order."""
    parts = " / ".join(fmt_time(plan.cost_breakdown.get(k)) for k in ("compute_s", "exposed_comm_s", "optimizer_s"))
    summary = _table(["", ""], [["mesh", mesh_text(plan)], ["device", plan.device],
                                ["step time", fmt_time(plan.estimated_step_time)],
                                ["compute / exposed comm / optimizer", parts],
                                ["peak memory per rank", fmt_bytes(plan.peak_memory_per_rank)
                                 + (f" of {fmt_bytes(plan.memory_limit)}" if plan.memory_limit else "")],
                                ["techniques", techniques_text(plan)],
                                ["recomputation", recompute_line(plan) or "none"]], "summary")
    sections = [("Summary", summary, []),
                ("Placement map", _placement_html(plan), [("placement_map", placement_figure(plan))]),
                ("Memory per rank", _table(["component", "bytes"], [[k, fmt_bytes(v)] for k, v in memory_items(plan)]),
                 [("memory", memory_figure(plan))])]
    groups = group_transitions(plan)
    comm_html = _table(["collective", "on", "edges", "time"], [[g["steps"], g["kind"], g["edges"],
                                                                 fmt_time(g["time_s"])] for g in groups[:20]])
    if not groups:
        comm_html = '<p class="none">No collectives: every tensor is where its consumers need it.</p>'
    sections.append(("Communication", comm_html, [("communication", comm_figure(plan))]))
    sections.append(("Top compute", "<p>Compute time per step of the largest ops (summed over layers).</p>",
                     [("top_ops", top_ops_figure(plan))]))
    sections.append(_fp8_section(plan))
    sections.append(_pipeline_section(plan))
    sections.append(_simulation_section(plan))
    sections.append(("Full plan", f"<pre>{html.escape(format_plan(plan))}</pre>", []))
    return sections


def _fp8_section(plan: Any) -> tuple:
    keys = fp8_nodes(plan)
    if not keys:
        return "FP8", '<p class="none">No FP8 matmuls chosen: every matmul runs in the compute dtype.</p>', []
    rows = [[k, plan.nodes[k].op, fmt_time(plan.nodes[k].compute_s)] for k in keys]
    return "FP8", _table(["node", "op", "compute"], rows), []


_KIND_COLORS = {"F": "#4c72b0", "B": "#c44e52", "I": "#dd8452", "W": "#55a868"}


def pipeline_figure(timeline: list, title: str) -> Figure | None:
    """Gantt chart of a pipeline step: one row per pipeline rank, forward (blue), full backward (red), backward
    for inputs (orange) and for weights (green) of each stage and microbatch, labeled `<stage><kind><mb>`."""
    if not timeline:
        return None
    def rank(lane: str) -> tuple:
        last = lane.rsplit(" ", 1)[-1]
        return (0, int(last), lane) if last.isdigit() else (1, 0, lane)

    timeline = [[str(r[0]), str(r[1]), r[2], r[3]] for r in timeline]
    lanes = sorted({r[0] for r in timeline}, key=rank)
    fig = Figure(figsize=(11, 0.9 + 0.45 * len(lanes)))
    ax = fig.subplots()
    scale, unit = time_unit(max(r[3] for r in timeline))
    for i, lane in enumerate(lanes):
        for kind, color in _KIND_COLORS.items():
            spans = [(r[2] * scale, (r[3] - r[2]) * scale) for r in timeline
                     if r[0] == lane and kind in r[1].lstrip("0123456789")[:1]]
            if spans:
                ax.broken_barh(spans, (i - 0.4, 0.8), color=color, edgecolor="white", linewidth=0.3)
    return _lanes_figure(fig, ax, lanes, unit, title)


def _pipeline_section(plan: Any) -> tuple:
    info = pipeline_info(plan)
    if info is None:
        return "Pipeline", '<p class="none">No pipeline stages in this plan.</p>', []
    rows = [[k, str(v)] for k, v in info.items() if k not in ("timeline", "schedules")]
    text = _table(["", ""], rows)
    if info.get("schedules"):
        text += _table(["schedule", "virtual stages", "step", "bubble", "peak memory", "fits"],
                       [[s["schedule"], str(s["virtual_stages"]), fmt_time(s["step_time_s"]),
                         f"{s['bubble_fraction']:.1%}", fmt_bytes(s["peak_memory"]), str(s["fits"])]
                        for s in info["schedules"]])
    title = (f"{info.get('schedule')}: {info.get('stages')} stages on {info.get('ranks')} ranks, "
             f"{info.get('microbatches')} microbatches (F forward, B backward, I/W input/weight gradients)")
    return "Pipeline", text, [("pipeline", pipeline_figure(info.get("timeline") or [], title))]


def _simulation_section(plan: Any) -> tuple:
    timeline = plan.timeline
    if not timeline:
        return ("Simulated step", '<p class="none">This plan records no simulated timeline (it was saved by an '
                "older autopar; re-plan to get it).</p>", [])
    note = (f"<p>Compute and communication streams of one simulated step (first {len(timeline)} events); "
            f"exposed communication {fmt_time(plan.cost_breakdown.get('exposed_comm_s'))}.</p>")
    return "Simulated step", note, [("timeline", timeline_figure(timeline, "simulated step (compute stream and "
                                                                               "one communication stream per axis)"))]


def write_report(plan: Any, path: str | os.PathLike, png_dir: str | os.PathLike | None = None,
                 title: str = "autopar plan report") -> list[str]:
    """Write one self-contained HTML file; returns the names of the embedded plots (also `png_dir/<name>.png`)."""
    sections = build_sections(plan)
    if png_dir is not None:
        os.makedirs(png_dir, exist_ok=True)
    body, written = [], []
    for head, text, figs in sections:
        body.append(f"<h2>{html.escape(head)}</h2>{text}")
        for name, fig in figs:
            if fig is None:
                continue
            png = _png(fig)
            body.append(_img(png, name))
            written.append(name)
            if png_dir is not None:
                with open(os.path.join(png_dir, f"{name}.png"), "wb") as f:
                    f.write(png)
    doc = (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
           f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1>{''.join(body)}</body></html>")
    with open(path, "w", encoding="utf-8") as f:
        f.write(doc)
    return written


__all__ = ["write_report", "build_sections", "placement_figure", "memory_figure", "comm_figure", "top_ops_figure",
           "timeline_figure", "placement_color"]
