"""A generated Program as text: which rank, what it holds (parameters, buffers and inputs with local shapes),
the collectives it issues in order with their process groups and buckets, and its code."""
from __future__ import annotations

import math
import re
from typing import Any

from rich import box
from rich.table import Table
from rich.text import Text

from autopar.inspect.fmt import axis_layout, fmt_bytes, fmt_count, render


def format_program(program: Any, *, width: int = 110, code: bool = True, max_collectives: int | None = 80,
                   color: bool = False) -> str:
    """Header, holdings, collectives (all of them with `max_collectives=None`) and, with `code`, the generated
    forward and backward graphs as Python."""
    parts: list[Any] = [Text("autopar program", style="bold underline"), _header(program), Text(""),
                        holdings_table(program), collectives_table(program, max_collectives)]
    text = render(parts, width=width, color=color)
    if code:
        text += "\n" + program.code()
    return text


def _header(program: Any) -> Table:
    rank, plan = program.rank, program.plan
    g = Table.grid(padding=(0, 2))
    g.add_column(style="bold")
    g.add_column()
    mesh = " x ".join(f"{a}={s}" for a, s in zip(rank.axis_names, rank.axis_sizes))
    coords = ", ".join(f"{a}={c}" for a, c in zip(rank.axis_names, rank.coords))
    g.add_row("rank", f"{rank.rank} of {math.prod(rank.axis_sizes)} on {mesh} (coordinates {coords})")
    groups = ", ".join(f"{a}: {n}" for a, n in zip(rank.axis_names, rank.group_names))
    g.add_row("groups", groups)
    g.add_row("step", "forward only (eval)" if program.forward_only else "forward + backward")
    m = getattr(program, "microbatches", 1)
    if getattr(program, "stage", None) is not None:
        pp = plan.pipeline
        recv = ", ".join(f"{a.name} {list(a.local_shape)}" for a in program.activations_in) or "the inputs"
        send = ", ".join(f"{a.name} {list(a.local_shape)}" for a in program.activations_out) or "the loss"
        g.add_row("stage", f"{program.stage} of {pp.stages} ({pp.schedule}, {m} microbatches): receives {recv}, "
                           f"sends {send}")
    elif m > 1:
        g.add_row("microbatches", f"{m}: gradients accumulate, grad_sync reduces them once per step")
    held = sum(math.prod(p.local_shape) for p in program.params)
    total = sum(math.prod(p.shape) for p in program.params)
    g.add_row("parameters", f"{fmt_count(held)} of {fmt_count(total)} elements held here "
                            f"({fmt_bytes(sum(math.prod(p.local_shape) * p.dtype.itemsize for p in program.params))})")
    kinds: dict[str, int] = {}
    for c in program.collectives:
        kinds[c.kind] = kinds.get(c.kind, 0) + 1
    g.add_row("collectives", ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) or "none")
    g.add_row("saved", f"{len(program.saved)} tensors for backward, {len(program.recomputed)} values recomputed "
                       "in backward")
    if plan is not None and plan.model:
        g.add_row("model", str(plan.model.get("name")))
    return g


def _pattern(name: str) -> str:
    """The block-relative form of a name (`layers.3.wq.weight` -> `layers.*.wq.weight`)."""
    return re.sub(r"(?<=\.)\d+(?=\.)|^\d+(?=\.)", "*", name)


def holdings_table(program: Any) -> Table:
    names = program.rank.axis_names
    t = Table(title="What this rank holds (identical layers folded into one row)", box=box.SIMPLE_HEAD,
              title_justify="left", pad_edge=False)
    for col, just in (("tensor", "left"), ("x", "right"), ("global", "left"), ("placement", "left"),
                      ("local", "left"), ("dtype", "left")):
        t.add_column(col, justify=just)
    for kind, specs in (("param", program.params), ("buffer", program.buffers), ("input", program.inputs)):
        rows: dict[tuple, int] = {}
        for s in specs:
            key = (_pattern(s.name), s.shape, tuple(s.layout), s.local_shape, str(s.dtype).removeprefix("torch."))
            rows[key] = rows.get(key, 0) + 1
        for (name, shape, layout, local, dtype), n in rows.items():
            label = name if kind != "input" else f"input {name.removeprefix('input/')}"
            t.add_row(label, str(n), str(list(shape)), axis_layout(names, layout), str(list(local)), dtype)
    return t


def collectives_table(program: Any, limit: int | None) -> Table | Text:
    cs = program.collectives
    if not cs:
        return Text("Collectives: none (this rank computes alone)")
    t = Table(title=f"Collectives in issue order ({len(cs)})", box=box.SIMPLE_HEAD, title_justify="left",
              pad_edge=False)
    for col, just in (("#", "right"), ("graph", "left"), ("collective", "left"), ("over", "left"),
                      ("in", "left"), ("bytes", "right"), ("carries", "left")):
        t.add_column(col, justify=just)
    shown = cs if limit is None else cs[:limit]
    for i, c in enumerate(shown):
        t.add_row(str(i), c.graph, c.kind, c.axes, f"{list(c.shape)} {str(c.dtype).removeprefix('torch.')}",
                  fmt_bytes(c.nbytes), _carries(c))
    if len(cs) > len(shown):
        t.add_row("...", "", f"{len(cs) - len(shown)} more", "", "", "", "(autopar program --all shows every one)")
    return t


def _carries(c: Any) -> str:
    if c.bucket:
        head = ", ".join(c.bucket[:3]) + (f", +{len(c.bucket) - 3} more" if len(c.bucket) > 3 else "")
        return f"bucket of {len(c.bucket)}: {head}"
    # "the input A of B" (lowering's wording) -> "A -> B"
    m = re.fullmatch(r"(?:the )?input (\S+) of (?:the )?(.+)", c.value)
    return f"{m.group(1)} -> {m.group(2)}" if m else c.value.removeprefix("the ")
