"""A node's strategy over the whole mesh: one layout per tensor input and per output, and the variant it runs."""
from __future__ import annotations

import dataclasses

from autopar.layout import fmt_layout

# Variants of a matmul besides the plain op (""), see autopar/fp8/variants.py: FP8 with one scale per operand,
# FP8 with one scale per row, and tensorwise FP8 whose FSDP-sharded weight is cast before its all-gather.
FP8_TENSORWISE = "fp8_tensorwise"
FP8_ROWWISE = "fp8_rowwise"
FP8_TENSORWISE_AG = "fp8_tensorwise_ag"
VARIANT_TEXT = {"": "bf16", FP8_TENSORWISE: "fp8 tensorwise", FP8_ROWWISE: "fp8 rowwise",
                FP8_TENSORWISE_AG: "fp8 tensorwise, fp8 all-gather"}


@dataclasses.dataclass(frozen=True)
class NodeStrategy:
    ins: tuple[tuple | None, ...]
    outs: tuple[tuple, ...]
    # "" runs the op as captured; a matmul may also run as an FP8 variant (the constants above).
    variant: str = ""

    def __str__(self) -> str:
        ins = " ".join(fmt_layout(i) if i is not None else "-" for i in self.ins)
        outs = " ".join(fmt_layout(o) for o in self.outs)
        text = f"{ins} -> {outs}" if self.ins else outs
        return f"{text} [{VARIANT_TEXT.get(self.variant, self.variant)}]" if self.variant else text
