"""Which forward values are recomputed in backward instead of saved: the one definition the planner's memory
model and time, and codegen, share.

Per repeated layer stack (a capture block such as `layers`) a plan records one variant:

    keep       every activation backward reads is saved (no recomputation)
    selective  the outputs of matmuls and fused attention kernels are saved; the cheap, memory-heavy ops between
               them (norms, activation functions, rotary embeddings, casts, softmax and the other attention
               internals, residual adds) are recomputed from them
    full       each layer is recomputed from its input (the residual stream entering it), which alone is saved
    full/r     the first r layers of the stack recomputed in full, the others keeping their activations
               (Megatron's "block" method: only as many layers recompute as the memory limit needs)
    full/r/selective
               the first r layers recomputed in full, the others selectively: between the two variants' memory
               at less time than full everywhere
The solver offers r at about a quarter, half and three quarters of the stack, in whole captured layers (one
stands for count / captured layers of the model: a planning template of 2 captured layers offers half).

Regions the model checkpoints itself (torch.utils.checkpoint, transformers' gradient_checkpointing_enable) are
recomputed whatever the plan says, but for the ops a selective checkpoint policy saves (`context_fn` from
`torch.utils.checkpoint.create_selective_checkpoint_contexts`: those it marks MUST_SAVE or PREFER_SAVE); a stack
whose forward the model checkpoints throughout is recorded as "full" by the model, or "selective" where its
policy saves some ops. Random ops (dropout) are never recomputed, nor what reads their outputs: their values are saved,
so backward sees the masks forward drew. A value read by forward code outside its region (a layer's output,
read by the next layer) is saved, not recomputed: recomputing it would chain every earlier layer into the
backward of the last one.

Whatever the variant, a forward view of an activation that the backward reads (a flattened matmul input, read
again for the weight gradient) is derived again in the backward from the value it views, not saved
(`rederived_views`): where the view reads that value in another layout (a sequence-parallel norm output gathered
for the MLP), codegen would otherwise save the redistributed copy to the end of the backward, which the memory
model does not count; the backward redistributes the saved value again instead (Megatron-LM's sequence-parallel
weight gradient gathers its input again the same way), and the planner prices that second redistribution.
"""
from __future__ import annotations

import operator
from typing import Any, Mapping

import torch
import torch.fx as fx

from autopar import _torch_compat as compat
from autopar.cost.compute import VIEW_OPS

VARIANTS = ("keep", "selective", "full")  # the variants every layer stack takes; partial ones are "full/r"


def split(variant: str) -> tuple[str, int | None, str]:
    """(variant of the first layers, how many of them (None: all), variant of the others): ("full", 16, "keep")
    for "full/16", ("full", 2, "selective") for "full/2/selective", ("selective", None, "selective") for
    "selective"."""
    kind, *rest = variant.split("/")
    if not rest:
        return kind, None, kind
    return kind, int(rest[0]), rest[1] if len(rest) > 1 else "keep"


def partial_variants(count: int, captured: int) -> list[str]:
    """The partial variants offered for a stack of `count` layers of which `captured` are in the graph: the
    first r layers recomputed in full and the others keeping ("full/r") or recomputing selectively
    ("full/r/selective"), for r about a quarter, half and three quarters of the stack, each a whole number of
    captured layers (one stands for count / captured), so the graph holds the plan exactly."""
    if captured < 2 or count % captured:
        return []
    per = count // captured
    picks = sorted({max(1, min(captured - 1, round(captured * q))) for q in (0.25, 0.5, 0.75)})
    return [f"full/{j * per}{rest}" for rest in ("", "/selective") for j in picks]


aten = torch.ops.aten
# Ops whose outputs selective recomputation keeps: the GEMMs and fused attention, which are costly to recompute.
_KEPT_BY_SELECTIVE = frozenset({
    aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.matmul, aten.linear, aten._scaled_mm, aten.convolution,
    aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_cudnn_attention,
    aten._scaled_dot_product_fused_attention_overrideable, aten._flash_attention_forward,
    aten._efficient_attention_forward,
})


def random(node: fx.Node) -> bool:
    """Whether the op draws random numbers: tagged so, and not an attention or dropout run with probability 0
    (scaled dot-product attention kernels carry the tag for their optional dropout)."""
    if node.op != "call_function" or torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
        return False
    schema = getattr(node.target, "_schema", None)
    for i, a in enumerate(schema.arguments if schema is not None else ()):
        if a.name in ("dropout_p", "p"):
            v = node.args[i] if i < len(node.args) else node.kwargs.get(a.name, a.default_value)
            return not (isinstance(v, (int, float)) and v == 0)
    return True


def kept_by_selective(node: fx.Node) -> bool:
    return getattr(node.target, "overloadpacket", None) in _KEPT_BY_SELECTIVE


def _model_checkpointing(cap: Any) -> dict[str, dict[int, tuple[bool, bool]]]:
    """Per layer stack, per captured layer with forward compute nodes: (whether the model checkpoints every one of
    them itself, whether a selective checkpoint policy saves any)."""
    out: dict[str, dict[int, tuple[bool, bool]]] = {}
    for n, (prefix, i) in cap.block_of.items():
        if n.op == "call_function" and cap.phase.get(n) == "fwd":
            every, saves = out.setdefault(prefix, {}).get(i, (True, False))
            out[prefix][i] = (every and n in cap.checkpointed, saves or compat.checkpoint_saves(n))
    return out


def model_checkpointed_stacks(cap: Any) -> dict[str, str]:
    """Layer stacks whose every forward compute node the model checkpoints itself, and the variant that is:
    "full", or "selective" where a selective checkpoint policy saves some of their ops."""
    return {prefix: "selective" if any(saves for _, saves in layers.values()) else "full"
            for prefix, layers in _model_checkpointing(cap).items() if all(every for every, _ in layers.values())}


def model_checkpointed_layers(cap: Any) -> dict[str, list[int]]:
    """Per layer stack, its captured layers (indices) whose every forward compute node the model checkpoints
    itself: all of them for model_checkpointed_stacks, some where the model checkpoints every n-th layer
    (transformers' activation_checkpointing_enable(every_n_layers=n))."""
    return {prefix: sorted(i for i, (every, _) in layers.items() if every)
            for prefix, layers in _model_checkpointing(cap).items()}


def rederived_views(cap: Any) -> frozenset[fx.Node]:
    """Forward views of activations (not of parameters or values of parameters alone) that the backward reads,
    directly or through further views: derived again in the backward rather than saved (module docstring)."""
    cached = getattr(cap, "_rederived_views", None)
    if cached is not None:
        return cached
    nodes = list(cap.gm.graph.nodes)
    persistent = {n for n in nodes if n.op == "get_attr"
                  or (n.op == "placeholder" and cap.names.get(n, "").split("/", 1)[0] != "input")}
    out: set[fx.Node] = set()
    for n in nodes:
        if n.op != "call_function" or cap.phase.get(n) != "fwd" or not n.all_input_nodes:
            continue
        if all(a in persistent for a in n.all_input_nodes):
            persistent.add(n)  # a value of parameters alone: gathered again in backward in any case
            continue
        if n.target is operator.getitem:
            if n.args[0] in out:  # an element of a split of a view
                out.add(n)
            continue
        a = n.all_input_nodes[0]
        if getattr(n.target, "overloadpacket", None) in VIEW_OPS and a not in persistent and _read_in_backward(cap, n):
            out.add(n)
    cap._rederived_views = frozenset(out)
    return cap._rederived_views


def _read_in_backward(cap: Any, v: fx.Node) -> bool:
    """Whether a backward op reads v or a view of it."""
    todo, seen = [v], set()
    while todo:
        n = todo.pop()
        for u in n.users:
            if u in seen or u.op != "call_function":
                continue
            seen.add(u)
            if cap.phase.get(u) == "bwd":
                return True
            if u.target is operator.getitem or getattr(u.target, "overloadpacket", None) in VIEW_OPS:
                todo.append(u)
    return False


def recomputed_nodes(cap: Any, variants: Mapping[str, str], model: bool = True) -> set[fx.Node]:
    """Forward nodes of `cap` that backward recomputes under `variants` ({stack prefix: variant}), together with
    the model's own checkpointed regions (without them: model=False, to say what they save), and the views the
    backward derives again (`rederived_views`)."""
    region: dict[fx.Node, tuple] = {}
    for n in cap.checkpointed if model else ():
        region[n] = ("checkpoint", compat.checkpoint_region(n))
    per = {b.prefix: b.count / b.captured for b in cap.blocks}  # the layers one captured layer stands for
    for n, (prefix, i) in cap.block_of.items():
        v, upto, others = split(variants.get(prefix, "keep"))
        if upto is not None and (i + 1) * per.get(prefix, 1.0) > upto + 1e-9:
            v = others  # a layer past the first `upto`
        if v == "keep" or n in region or n.op != "call_function" or cap.phase.get(n) != "fwd":
            continue
        if n.target is operator.getitem:
            continue  # a tuple element follows its producer, below
        if v == "full" or not kept_by_selective(n):
            region[n] = ("layer", prefix, i)
    for n in cap.block_of:
        if n.op == "call_function" and n.target is operator.getitem and n.args[0] in region:
            region.setdefault(n, region[n.args[0]])

    def home(u: fx.Node):
        if u in region:
            return region[u]
        return ("layer", *cap.block_of[u]) if u in cap.block_of else None

    out = set()
    for n, r in region.items():
        if random(n) or any(random(a) for a in n.all_input_nodes):
            continue
        if r[0] == "checkpoint" and compat.checkpoint_saves(n):  # the model's selective policy saves it
            continue
        # Read by forward code of another region (or of no layer): saved, as the region's output.
        if any(u.op == "call_function" and cap.phase.get(u) == "fwd" and home(u) != r for u in n.users):
            continue
        out.add(n)
    return out | rederived_views(cap)


def plan_variants(plan: Any) -> dict[str, str]:
    """{stack prefix: variant} a plan records (plan.recompute; "full/r" where it records "layers": r, and
    "full/r/selective" with "others": "selective")."""
    return {p: join(d["variant"], d.get("layers"), d.get("others", "keep"))
            for p, d in (getattr(plan, "recompute", None) or {}).items()}


def join(kind: str, layers: int | None, others: str = "keep") -> str:
    """The variant string of split's parts."""
    if layers is None:
        return kind
    return f"{kind}/{layers}" + ("" if others == "keep" else f"/{others}")
