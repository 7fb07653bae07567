"""A node's strategy over the whole mesh: one layout per tensor input and per output."""
from __future__ import annotations

import dataclasses

from autopar.layout import fmt_layout


@dataclasses.dataclass(frozen=True)
class NodeStrategy:
    ins: tuple[tuple | None, ...]
    outs: tuple[tuple, ...]

    def __str__(self) -> str:
        ins = " ".join(fmt_layout(i) if i is not None else "-" for i in self.ins)
        outs = " ".join(fmt_layout(o) for o in self.outs)
        return f"{ins} -> {outs}" if self.ins else outs
