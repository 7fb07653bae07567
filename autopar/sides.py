"""Where each node of a captured step sits relative to its repeated layers: in a layer ("block"), before them
("first": the embedding, run by a pipeline's first stage) or after them ("last": the head and the loss, run by
its last stage). Pipeline planning prices stages by side and codegen cuts stage programs by it."""
from __future__ import annotations

import torch.fx as fx

from autopar.capture import Captured


def node_sides(cap: Captured) -> dict[fx.Node, str]:
    """Node -> "first" | "block" | "last".

    A layer's nodes are "block". Other forward nodes before the first layer's are "first", after it "last";
    backward nodes before the first layer's backward are "last" (the head's), after it "first". Values
    computed from graph inputs alone (`sources`) go with their first reader: "last" if it is last, else
    "first". Parameters and buffers of a layer are "block"."""
    nodes = list(cap.gm.graph.nodes)
    blocks = [i for i, n in enumerate(nodes) if n in cap.block_of]
    fwd0 = min((i for i in blocks if cap.phase[nodes[i]] == "fwd"), default=len(nodes))
    bwd0 = min((i for i in blocks if cap.phase[nodes[i]] == "bwd"), default=len(nodes))
    side: dict[fx.Node, str] = {}
    for i, n in enumerate(nodes):
        if n in cap.block_of:
            side[n] = "block"
        elif n.op == "call_function":
            side[n] = ("first" if i < fwd0 else "last") if cap.phase[n] == "fwd" else ("last" if i < bwd0 else "first")
    src = sources(cap)
    order = {n: i for i, n in enumerate(nodes)}
    for n in reversed(nodes):
        if n in src:
            users = sorted((u for u in n.users if u in side), key=order.__getitem__)
            if n.op == "placeholder" and in_block_state(cap, n):
                side[n] = "block"
            else:
                side[n] = "last" if users and side[users[0]] == "last" else "first"
    return side


def sources(cap: Captured) -> set[fx.Node]:
    """Graph inputs and constants, and the values computed from them alone outside the layers (a buffer's slice,
    a count of labels, a mask built from the inputs): any stage can compute them for itself."""
    out = {n for n in cap.gm.graph.nodes if n.op in ("placeholder", "get_attr")}
    for n in cap.gm.graph.nodes:
        if n.op == "call_function" and n not in cap.block_of and all(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


def in_block_state(cap: Captured, node: fx.Node) -> bool:
    """A parameter or buffer of one of the repeated layers."""
    fqn = cap.names[node].split("/", 1)[-1]
    return cap.stack_of(fqn) is not None
