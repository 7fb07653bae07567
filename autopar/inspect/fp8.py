"""FP8 in a plan as text: the header line, the table of matmuls that run in FP8, and a node's variant costs."""
from __future__ import annotations

from typing import Any

from rich import box
from rich.table import Table
from rich.text import Text

from autopar.inspect.fmt import fmt_time, node_module
from autopar.strategy import VARIANT_TEXT

_MAX_ROWS = 24


def fp8_line(plan: Any) -> str | None:
    """One line for the plan header: how many matmul runs per step are FP8 and the compute time that saves, or,
    with FP8 off on FP8 hardware, what Config(fp8="auto") would save; None when no matmul may run in FP8."""
    f = plan.fp8
    if not f:
        return None
    runs = f"{f.get('fp8_gemms', 0):g} of {f.get('eligible_gemms', 0):g} matmul runs per step"
    if f.get("mode") == "off":
        would = f.get("auto_would_save_s")
        if would is None:
            return None
        return (f"off; Config(fp8='auto') would save about {fmt_time(would)} of compute per step on these "
                "layouts (FP8 changes numerics: opt in)")
    return f"{f['mode']}: {runs} in FP8, estimated gain {fmt_time(f.get('compute_saved_s', 0.0))} of compute per step"


def fp8_table(plan: Any) -> Table | None:
    """The matmuls that run in FP8, by module: variant, time as planned and in the compute dtype."""
    rows = [(k, n) for k, n in sorted(plan.nodes.items()) if n.variant]
    if not rows:
        return None
    plain = plan.mixed_precision or "bf16"
    t = Table(title=f"FP8 matmuls: {len(rows)} of {sum(1 for n in plan.nodes.values() if n.variant_costs)} kinds",
              box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False)
    for col, just in (("module", "left"), ("matmul", "left"), ("variant", "left"), (plain, "right"),
                      ("fp8", "right"), ("saved", "right")):
        t.add_column(col, justify=just)
    for key, n in rows[:_MAX_ROWS]:
        base = n.variant_costs.get(plain)
        t.add_row(node_module(key), key.split("/", 1)[1], VARIANT_TEXT.get(n.variant, n.variant), fmt_time(base),
                  fmt_time(n.compute_s), fmt_time(base - n.compute_s) if base is not None else "-")
    if len(rows) > _MAX_ROWS:
        t.add_row(f"... {len(rows) - _MAX_ROWS} more", "", "", "", "", "")
    return t


def variant_rows(plan: Any, keys: list[str]) -> list:
    """Explain's part for matmuls that may run in FP8: each variant's time per step on the chosen layout."""
    keys = [k for k in keys if plan.nodes.get(k) is not None and plan.nodes[k].variant_costs]
    if not keys:
        return []
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    t.add_column("matmul")
    variants = list(dict.fromkeys(v for k in keys for v in plan.nodes[k].variant_costs))
    for v in variants:
        t.add_column(v, justify="right")
    t.add_column("runs as")
    for k in keys:
        n = plan.nodes[k]
        chosen = VARIANT_TEXT.get(n.variant, n.variant) if n.variant else (plan.mixed_precision or "bf16")
        t.add_row(k, *(fmt_time(n.variant_costs.get(v)) for v in variants), chosen)
    note = Text("Each matmul in the compute dtype and in FP8 on its chosen layout, per step (FP8: the GEMM at the FP8 "
                "peak plus its amax/scale/cast kernels; the all-gather variant also gathers the weight in FP8).")
    return [Text(""), Text("FP8 or not"), note, t]


__all__ = ["fp8_line", "fp8_table", "variant_rows"]
