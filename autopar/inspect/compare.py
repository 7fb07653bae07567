"""The text view of a solver-vs-recipes comparison."""
from __future__ import annotations

from typing import Any

from rich import box
from rich.table import Table

from autopar.inspect.techniques import techniques_text
from autopar.inspect.fmt import fmt_bytes, fmt_time, render


def compare_table(result: Any, width: int = 110) -> str:
    """The comparison (an autopar.recipes.CompareResult) as a text table: one row per plan, the solver's first."""
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, title_justify="left",
              title="Solver plan vs hand-written recipes (same cost model)"
              + (f"; memory limit {fmt_bytes(result.memory_limit)} per rank" if result.memory_limit else ""))
    for col in ("plan", "step time", "exposed comm", "peak memory/rank", "fits", "vs solver", "techniques / note"):
        t.add_column(col, justify="left" if col in ("plan", "techniques / note") else "right")
    for r in result.rows:
        if r.plan is None:
            t.add_row(r.name, "-", "-", "-", "-", "-", f"not run: {r.reason}")
            continue
        note = techniques_text(r.plan) + (f"; {r.reason}" if r.reason else "")
        t.add_row(r.name, fmt_time(r.step_time), fmt_time(r.exposed_comm), fmt_bytes(r.peak_memory),
                  "yes" if r.fits else "NO", f"{r.ratio:.2f}x" if r.ratio is not None else "-", note)
    return render([t], width=width)
