"""Why a plan chose what it chose (`explain`), and how two plans differ (`diff`)."""
from __future__ import annotations

import difflib
from typing import Any

from rich import box
from rich.table import Table
from rich.text import Text

from autopar.inspect.fp8 import variant_rows
from autopar.inspect.recompute import explain_stack, node_note
from autopar.inspect.techniques import techniques_text
from autopar.strategy import VARIANT_TEXT
from autopar.inspect.fmt import (axis_layout, delta_bytes, delta_time, describe_placement, fmt_bytes, fmt_count,
                                 fmt_time, instances, mesh_text, r6, render, shard_factor, signed)
from autopar.layout import fmt_layout

_NEAR = 0.01  # alternatives within 1% of the chosen time count as ties (cost rounding)
_DIFF_ROWS = 40


# --- name resolution ----------------------------------------------------------------------------------------

def resolve(plan: Any, name: str) -> tuple[str, str]:
    """("param" | "node", plan key) for a parameter FQN, a node key, or a unique suffix or module of either;
    block indices (`layers.3.`) and `param/` prefixes are accepted."""
    raw = name.strip()
    key = plan.key(raw.removeprefix("param/"))
    if key in plan.params:
        return "param", key
    if plan.key(raw) in plan.nodes:
        return "node", plan.key(raw)
    key = plan.key(raw.removeprefix("param/"))
    # A partial name matches whole dotted segments: `wq` and `attention.wq` find `layers.*.attention.wq.weight`.
    params = [k for k in plan.params if f".{key}." in f".{k}."]
    if len(params) == 1:
        return "param", params[0]
    nodes = [k for k in plan.nodes if not k.startswith(("param/", "input/", "buffer/", "tangent/"))
             and (k.endswith(("/" + key, "." + key)) or f".{key}/" in f".{k}")]
    if not params and len(nodes) == 1:
        return "node", nodes[0]
    if params or nodes:
        found = params or nodes
        raise ValueError(f"{name!r} matches {len(found)} {'parameters' if params else 'nodes'}; name one of: "
                         + ", ".join(found[:12]) + (" ..." if len(found) > 12 else ""))
    close = difflib.get_close_matches(key, list(plan.params) + list(plan.nodes), n=5, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else "; see the parameter names in str(plan)"
    raise ValueError(f"{name!r} is neither a parameter nor a node of this plan{hint}")


# --- explain ------------------------------------------------------------------------------------------------

def explain(plan: Any, name: str, width: int = 110) -> str:
    """Chosen layout of a parameter or node, what it costs, and the alternatives with their cost deltas."""
    if name.strip() in getattr(plan, "recompute", {}):
        return explain_stack(plan, name.strip())
    kind, key = resolve(plan, name)
    parts = _explain_param(plan, key) if kind == "param" else _explain_node(plan, key)
    node = plan.nodes.get(f"param/{key}" if kind == "param" else key)
    parts += _alternatives(plan, node)
    module = key.rsplit(".", 1)[0] if kind == "param" else None
    parts += variant_rows(plan, [key] if module is None else sorted(k for k in plan.nodes
                                                                     if k.startswith(f"{module}/")))
    parts += _transitions(plan, f"param/{key}" if kind == "param" else key)
    return render(parts, width=width)


def _explain_param(plan: Any, key: str) -> list:
    names, lay = plan.mesh.axis_names, plan.params[key]
    n = instances(plan, key)
    numel = plan.param_numel.get(key)
    head = f"parameter {key}" + (f"  (one per layer, x{n})" if n > 1 else "")
    g = Table.grid(padding=(0, 2))
    g.add_column(style="bold")
    g.add_column()
    g.add_row("placement", axis_layout(names, lay))
    for a, p in zip(names, lay):
        g.add_row(f"  over {a}", describe_placement(p) + (f" ({plan.mesh.axis_size(a)} ways)" if
                                                        describe_placement(p) != "replicated" else ""))
    if numel is not None:
        g.add_row("elements", f"{fmt_count(numel)}{' per layer' if n > 1 else ''}, "
                              f"{fmt_count(numel / shard_factor(lay, plan.mesh.shape))} of them per rank")
    return [Text(head, style="bold underline"), g]


def _explain_node(plan: Any, key: str) -> list:
    names, node = plan.mesh.axis_names, plan.nodes[key]
    g = Table.grid(padding=(0, 2))
    g.add_column(style="bold")
    g.add_column()
    g.add_row("op", f"{node.op}" + (f"  (x{node.count:g} in the model)" if node.count != 1 else ""))
    for i, lay in enumerate(node.ins):
        g.add_row(f"input {i}", axis_layout(names, lay))
    for i, lay in enumerate(node.outs):
        g.add_row(f"output {i}", axis_layout(names, lay))
    per = f", {fmt_time(node.compute_s / node.count)} each" if node.count > 1 else ""
    g.add_row("compute", f"{fmt_time(node.compute_s)} per step{per}")
    if node.variant:
        g.add_row("runs as", VARIANT_TEXT.get(node.variant, node.variant))
    note = node_note(plan, key)
    if note:
        g.add_row("recompute", note)
    return [Text(f"node {key}", style="bold underline"), g]


def _alternatives(plan: Any, node: Any) -> list:
    if node is None or not node.alternatives:
        return [Text(""), Text("why: this is the only legal layout (pinned, or the shapes allow nothing else)")]
    chosen = next((a for a in node.alternatives if a.get("chosen")), node.alternatives[0])
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for col, just in (("", "left"), ("strategy (ins -> outs, axes " + ",".join(plan.mesh.axis_names) + ")", "left"),
                      ("time", "right"), ("vs chosen", "right"), ("memory/rank", "right"), ("vs chosen", "right")):
        t.add_column(col, justify=just)
    for a in node.alternatives:
        dt = a["time_s"] - chosen["time_s"]
        dm = a["memory_bytes"] - chosen["memory_bytes"]
        mark = "*" if a.get("chosen") else ""
        t.add_row(mark, a["strategy"], fmt_time(a["time_s"]), "" if mark else signed(fmt_time(dt), dt),
                  fmt_bytes(a["memory_bytes"]), "" if mark else signed(fmt_bytes(dm), dm))
    note = Text("Alternatives, each priced with every other choice held fixed: compute plus the collectives on "
                "its edges; memory per rank, summed over repeated layers.")
    return [Text(""), Text("why: " + _why(plan, chosen, node.alternatives)), Text(""), note, t]


def _why(plan: Any, chosen: dict, alts: list[dict]) -> str:
    others = [a for a in alts if not a.get("chosen")]
    tol = max(abs(chosen["time_s"]) * _NEAR, 1e-12)
    faster = [a for a in others if a["time_s"] < chosen["time_s"] - tol]
    if not faster:
        lean = [a for a in others if a["time_s"] <= chosen["time_s"] + tol]
        if lean:
            return ("tied for the fastest option here; the tie goes to the lower-memory layout or to what "
                    "neighbouring nodes prefer")
        if not others:
            return "the fastest option here"
        nxt = min(others, key=lambda a: a["time_s"])
        return f"the fastest option here; the next best ({nxt['strategy']}) is " \
               f"{fmt_time(nxt['time_s'] - chosen['time_s'])} slower"
    best = min(faster, key=lambda a: a["time_s"])
    gain = chosen["time_s"] - best["time_s"]
    extra = best["memory_bytes"] - chosen["memory_bytes"]
    if extra > 0:
        return (f"{best['strategy']} would be {fmt_time(gain)} faster but needs {fmt_bytes(extra)} more per rank; "
                f"the plan trades that time for memory to stay under the limit ({fmt_bytes(plan.memory_limit)})")
    return (f"locally {best['strategy']} looks {fmt_time(gain)} faster; the global solve chose otherwise because "
            "this decision is shared by every layer and fixes the layouts its neighbours can use")


def _transitions(plan: Any, key: str) -> list:
    rows = [t for t in plan.transitions if key in (t.src, t.dst)]
    if not rows:
        return [Text(""), Text("collectives: none on this entry's edges")]
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("edge", "kind", f"layout ({','.join(plan.mesh.axis_names)})", "steps", "time"):
        t.add_column(col, justify="right" if col == "time" else "left")
    for tr in sorted(rows, key=lambda x: (-r6(x.cost_s), x.src, x.dst, x.arg)):
        other = tr.dst if tr.src == key else tr.src
        arrow = "to " if tr.src == key else "from "
        t.add_row(arrow + other, tr.kind, f"{fmt_layout(tr.src_layout)} -> {fmt_layout(tr.dst_layout)}", tr.steps,
                  fmt_time(tr.cost_s))
    return [Text(""), Text("Layout changes on its edges"), t]


# --- diff ---------------------------------------------------------------------------------------------------

def diff(a: Any, b: Any, width: int = 110, labels: tuple[str, str] = ("a", "b")) -> str:
    """Parameters and nodes whose layouts differ between two plans, and the step time and memory deltas."""
    la, lb = labels
    g = Table.grid(padding=(0, 2))
    g.add_column(style="bold")
    g.add_column()
    if a.mesh != b.mesh:
        g.add_row("mesh", f"{mesh_text(a)} -> {mesh_text(b)}")
    if a.fingerprint != b.fingerprint:
        g.add_row("note", "the plans are for different models, inputs or meshes; only shared names are compared")
    g.add_row("step time", delta_time(a.estimated_step_time, b.estimated_step_time))
    for k, label in (("compute_s", "compute"), ("exposed_comm_s", "exposed comm")):
        if k in a.cost_breakdown or k in b.cost_breakdown:
            g.add_row(label, delta_time(a.cost_breakdown.get(k, 0.0), b.cost_breakdown.get(k, 0.0)))
    g.add_row("peak memory", delta_bytes(a.peak_memory_per_rank, b.peak_memory_per_rank))
    ta, tb = techniques_text(a), techniques_text(b)
    g.add_row("techniques", ta if ta == tb else f"{ta} -> {tb}")
    parts: list = [Text(f"plan diff: {la} -> {lb}", style="bold underline"), g]
    parts += _diff_params(a, b, la, lb)
    parts += _diff_nodes(a, b, la, lb)
    return render(parts, width=width)


def changed_params(a: Any, b: Any) -> list[str]:
    return sorted(k for k in a.params.keys() & b.params.keys() if a.params[k] != b.params[k])


def changed_nodes(a: Any, b: Any) -> list[str]:
    return sorted(k for k in a.nodes.keys() & b.nodes.keys() if not k.startswith("param/")
                  and (a.nodes[k].ins, a.nodes[k].outs, a.nodes[k].variant)
                  != (b.nodes[k].ins, b.nodes[k].outs, b.nodes[k].variant))


def _diff_params(a: Any, b: Any, la: str, lb: str) -> list:
    keys = changed_params(a, b)
    only = sorted(a.params.keys() ^ b.params.keys())
    if not keys and not only:
        return [Text(""), Text(f"parameters: all {len(a.params)} placed the same")]
    t = Table(title=f"Parameters placed differently: {len(keys)} of {len(a.params.keys() & b.params.keys())}",
              box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False)
    t.add_column("parameter")
    t.add_column(la)
    t.add_column(lb)
    for k in keys:
        t.add_row(k, axis_layout(a.mesh.axis_names, a.params[k]), axis_layout(b.mesh.axis_names, b.params[k]))
    for k in only:
        t.add_row(k, axis_layout(a.mesh.axis_names, a.params[k]) if k in a.params else "(absent)",
                  axis_layout(b.mesh.axis_names, b.params[k]) if k in b.params else "(absent)")
    return [Text(""), t]


def _diff_nodes(a: Any, b: Any, la: str, lb: str) -> list:
    keys = changed_nodes(a, b)
    if not keys:
        return [Text(""), Text("nodes: every op runs with the same layouts")]
    ranked = sorted(keys, key=lambda k: (-r6(max(a.nodes[k].compute_s, b.nodes[k].compute_s)), k))
    t = Table(title=f"Ops with different layouts: {len(keys)} of {len(a.nodes)} (largest compute first)",
              box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False)
    for col in ("node", f"{la} output", f"{lb} output", "compute"):
        t.add_column(col, justify="right" if col == "compute" else "left")
    for k in ranked[:_DIFF_ROWS]:
        na, nb = a.nodes[k], b.nodes[k]
        oa = axis_layout(a.mesh.axis_names, na.outs[0]) if na.outs else "-"
        ob = axis_layout(b.mesh.axis_names, nb.outs[0]) if nb.outs else "-"
        if oa == ob:  # same output, different inputs: show the first differing input instead
            i = next((i for i, (x, y) in enumerate(zip(na.ins, nb.ins)) if x != y), 0)
            oa = f"in{i} {axis_layout(a.mesh.axis_names, na.ins[i] if na.ins else None)}"
            ob = f"in{i} {axis_layout(b.mesh.axis_names, nb.ins[i] if nb.ins else None)}"
        t.add_row(k, oa, ob, f"{fmt_time(na.compute_s)} -> {fmt_time(nb.compute_s)}")
    if len(ranked) > _DIFF_ROWS:
        t.add_row(f"... {len(ranked) - _DIFF_ROWS} more", "", "", "")
    return [Text(""), t]


__all__ = ["explain", "diff", "resolve", "changed_params", "changed_nodes"]
