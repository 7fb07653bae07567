"""Activation recomputation as the plan records it (Plan.recompute): one line per layer stack, and what explain
says of a stack or of a node inside a recomputed one."""
from __future__ import annotations

from typing import Any

from autopar.inspect.fmt import fmt_bytes, fmt_time

_WHAT = {"selective": "selective (norms, activations, attention internals recomputed; matmul outputs kept)",
         "full": "full (each layer recomputed from its input)", "keep": "none (activations kept)"}
_BY = {"solver": "chosen by the solver", "config": "set by Config.recompute",
       "model": "the model checkpoints these layers itself"}


def _variant(plan: Any, d: dict) -> str:
    """'full' or, where only the first r layers recompute in full, 'full on the first 16 of 32 layers' (and
    ', selective on the others'); where the model checkpoints some layers itself, ', 16 of 32 layers
    checkpointed by the model' after it."""
    model = f", {d['model_layers']} of {d.get('of') or '?'} layers checkpointed by the model" \
        if d.get("model_layers") else ""
    if d.get("layers") is None:
        return d["variant"] + model
    rest = ", selective on the others" if d.get("others") == "selective" else ""
    return f"{d['variant']} on the first {d['layers']} of {d.get('of') or '?'} layers{rest}{model}"


def recompute_line(plan: Any) -> str:
    """'layers: full, +12.3 ms per step, saves 4.1 GiB per rank (chosen by the solver)' per recomputing stack;
    empty when no stack recomputes."""
    parts = []
    for prefix in _stacks(plan):
        d = plan.recompute[prefix]
        what = _variant(plan, dict(d, of=plan.blocks.get(prefix)))
        parts.append(f"{prefix}: {what}, +{fmt_time(d.get('time_s', 0.0))} per step, saves "
                     f"{fmt_bytes(d.get('saved_bytes', 0))} per rank ({_BY.get(d.get('by'), d.get('by'))})")
    return "; ".join(parts)


def explain_stack(plan: Any, prefix: str) -> str:
    d = plan.recompute[prefix]
    what = _WHAT.get(d["variant"], d["variant"])
    if d.get("by") == "model" and d["variant"] == "selective":  # the model's own policy, not autopar's variant
        what = "selective (the outputs the model's checkpoint policy saves are kept, the rest recomputed)"
    lines = [f"layer stack {prefix} ({plan.blocks.get(prefix, '?')} layers)",
             f"  recomputation: {what}, {_BY.get(d.get('by'), d.get('by'))}"]
    if d.get("layers") is not None:
        rest = _WHAT[d.get("others", "keep")]
        lines[-1] = (f"  recomputation: full on the first {d['layers']} of the {plan.blocks.get(prefix, '?')} "
                     f"layers (each recomputed from its input), {_BY.get(d.get('by'), d.get('by'))}")
        lines.append(f"  the other layers: {rest}")
    if d.get("model_layers"):
        lines.append(f"  the model checkpoints {d['model_layers']} of the layers itself: they are recomputed in "
                     "backward whatever the plan says")
    if d["variant"] != "keep" or d.get("model_layers"):
        lines.append(f"  time added: {fmt_time(d.get('time_s', 0.0))} per step (the recomputed forward ops on "
                     "their local shapes)")
        lines.append(f"  memory saved: {fmt_bytes(d.get('saved_bytes', 0))} per rank at the peak")
    elif d.get("by") == "solver":
        lines.append("  why: the plan fits the memory limit without it, and recomputing costs time")
    return "\n".join(lines) + "\n"


def node_note(plan: Any, key: str) -> str | None:
    """For a forward node inside a recomputing stack: how the stack recomputes."""
    for prefix in _stacks(plan):
        if key.startswith(f"{prefix}.*.") and "/fwd/" in key:
            d = plan.recompute[prefix]
            return (f"{prefix} recomputes its activations ({_variant(plan, dict(d, of=plan.blocks.get(prefix)))}) "
                    "in backward")
    return None


def _stacks(plan: Any) -> list[str]:
    rc = getattr(plan, "recompute", None) or {}
    return [p for p, d in sorted(rc.items()) if d.get("variant", "keep") != "keep" or d.get("model_layers")]
