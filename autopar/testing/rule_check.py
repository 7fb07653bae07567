"""Check sharding rules against real execution: simulate the ranks of one mesh axis in one process.

For each strategy of an op, every rank gets its local inputs (Shard: its chunk; Replicate: the whole tensor;
Partial: random parts that sum, or average, to the value), runs the op on them, and the outputs are reassembled
(Shard: concatenated in rank order; Replicate: all ranks must agree; Partial: summed or averaged) and compared
with the op run on the whole inputs. Floating tensors run in float64, so only a wrong rule can fail.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Placement, Shard

from autopar.layout import local_shape
from autopar.rules import AxisStrategy, OpInfo, TensorMeta, axis_strategies, fmt_strategy, local_call, op_info

RTOL, ATOL = 1e-5, 1e-6
# Ops whose values are undefined or random: their layouts are not checked by value.
UNCHECKED = {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"}


def check_node(node: fx.Node, real_inputs: tuple[Sequence, dict], mesh_size: int,
               strategies: Sequence[AxisStrategy] | None = None) -> list[str]:
    """Errors (naming op and strategy) of every strategy of `node`, run on its concrete (args, kwargs)."""
    args, kwargs = real_inputs
    return check_call(node.target, args, kwargs, mesh_size, info=op_info(node), strategies=strategies)


def check_call(target, args: Sequence, kwargs: dict, mesh_size: int, *, info: OpInfo | None = None,
               strategies: Sequence[AxisStrategy] | None = None, seed: int = 0) -> list[str]:
    """Errors of every strategy of `target(*args, **kwargs)` (by default the registry's) on `mesh_size` ranks."""
    if not _checkable(target, args, kwargs):
        return []
    args, kwargs = _upcast((tuple(args), dict(kwargs)))
    with _one_thread():
        ref = _as_list(target(*args, **kwargs))
    info = info or info_of(target, args, kwargs, ref)
    if strategies is None:
        strategies = axis_strategies(info)[0]
    gen = torch.Generator().manual_seed(seed)
    errors = []
    with _one_thread():
        for s in strategies:
            if not _divides(info, s, mesh_size):
                continue
            try:
                err = _check_strategy(target, args, kwargs, info, s, mesh_size, ref, gen)
            except Exception as e:  # noqa: BLE001 - a rule that makes the op fail on local shapes is wrong
                err = f"raised {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            if err:
                errors.append(f"{target} [{fmt_strategy(s)}] on {mesh_size} ranks: {err}")
    return errors


def info_of(target, args: Sequence, kwargs: dict, outs: Sequence) -> OpInfo:
    """OpInfo from concrete values (what `op_info` gives for a traced node)."""
    meta = lambda x: _map_tensors(x, lambda t: TensorMeta(tuple(t.shape), t.dtype))  # noqa: E731
    inputs: list = []
    _map_tensors((args, kwargs), lambda t: inputs.append(TensorMeta(tuple(t.shape), t.dtype)) or t)
    return OpInfo(target, meta(tuple(args)), meta(dict(kwargs)), tuple(inputs),
                  tuple(TensorMeta(tuple(o.shape), o.dtype) if isinstance(o, torch.Tensor) else None for o in outs))


class Recorder(fx.Interpreter):
    """Runs a graph on real tensors and keeps every call_function node's concrete (args, kwargs)."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.calls: dict[fx.Node, tuple[tuple, dict]] = {}

    def run_node(self, n: fx.Node) -> Any:
        if n.op == "call_function":
            self.calls[n] = self.fetch_args_kwargs_from_env(n)
        return super().run_node(n)


def placeholder_values(cap, model: torch.nn.Module, args: Sequence, kwargs: dict | None = None) -> list[Any]:
    """Real values for a captured graph's placeholders: the model's parameters and buffers, the example inputs
    (tensor leaves of args then kwargs, in order) and ones for the loss tangent."""
    by_node = {node: model.get_parameter(fqn) for fqn, node in cap.params.items()}
    by_node.update({node: model.get_buffer(fqn) for fqn, node in cap.buffers.items()})
    by_node.update(zip(cap.inputs, _tensors(tuple(args), dict(kwargs or {}))))
    by_node.update({node: torch.ones(node.meta["val"].shape, dtype=node.meta["val"].dtype) for node in cap.tangents})
    values = []
    for node in cap.gm.graph.nodes:
        if node.op == "placeholder":
            v, meta = by_node[node].detach(), node.meta["val"]
            if tuple(v.shape) != tuple(meta.shape) or v.dtype != meta.dtype:
                raise ValueError(f"placeholder {node.name}: got {tuple(v.shape)} {v.dtype}, graph expects "
                                 f"{tuple(meta.shape)} {meta.dtype}")
            values.append(v)
    return values


def record_calls(gm: fx.GraphModule, placeholder_values: Sequence[Any]) -> dict[fx.Node, tuple[tuple, dict]]:
    rec = Recorder(gm)
    with torch.no_grad(), _one_thread():
        rec.run(*placeholder_values)
    return rec.calls


def check_graph(gm: fx.GraphModule, calls: dict[fx.Node, tuple[tuple, dict]], mesh_size: int,
                skip: Callable[[fx.Node], bool] = lambda n: False) -> list[str]:
    """Check every call_function node once per distinct (op, argument metadata)."""
    errors, seen = [], set()
    for node in gm.graph.nodes:
        if node.op != "call_function" or node not in calls or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if skip(node):
            continue
        info = op_info(node)
        key = (info.target, repr(info.args), repr(info.kwargs))
        if key in seen:
            continue
        seen.add(key)
        errors += check_node(node, calls[node], mesh_size)
    return errors


def graph_ops(cap) -> set:
    """The ATen ops a captured graph calls."""
    return {n.target for n in cap.compute_nodes() if isinstance(n.target, torch._ops.OpOverload)}


def ops_without_rules(cap) -> list[str]:
    """The ATen ops of a captured graph that no sharding rule covers (they would run replicated)."""
    return sorted({str(n.target) for n in cap.compute_nodes()
                   if isinstance(n.target, torch._ops.OpOverload) and not axis_strategies(op_info(n))[1]})


def check_captured(cap, model: torch.nn.Module, args: Sequence, kwargs: dict | None = None,
                   mesh_sizes: Sequence[int] = (2, 4)) -> list[str]:
    """Run a captured model's joint graph on its real weights and inputs; check every op on each mesh size."""
    calls = record_calls(cap.gm, placeholder_values(cap, model, args, kwargs))
    return [e for n in mesh_sizes for e in check_graph(cap.gm, calls, n)]


@contextlib.contextmanager
def _one_thread():
    """Tiny ops are much faster single-threaded, and several threads fight over busy CI cores."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def _checkable(target, args: Sequence, kwargs: dict) -> bool:
    if not isinstance(target, torch._ops.OpOverload) or target.overloadpacket.__name__ in UNCHECKED:
        return False
    return torch.Tag.nondeterministic_seeded not in target.tags or _no_dropout(target, args, kwargs)


def _no_dropout(target, args: Sequence, kwargs: dict) -> bool:
    """A random op (attention, dropout) is deterministic when its dropout probability is 0."""
    for i, a in enumerate(target._schema.arguments):
        if a.name in ("dropout_p", "p"):
            value = args[i] if i < len(args) else kwargs.get(a.name, a.default_value)
            return value == 0
    return False


def _map_tensors(x: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """Apply fn to the tensor leaves, walking tuples, lists and dict values as `flat_tensor_args` does."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_map_tensors(a, fn) for a in x)
    if isinstance(x, dict):
        return {k: _map_tensors(v, fn) for k, v in x.items()}
    return x


_LOW = (torch.float32, torch.float16, torch.bfloat16)


def _upcast(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.double() if x.dtype in _LOW else x
    if isinstance(x, torch.dtype):
        return torch.float64 if x in _LOW else x
    if isinstance(x, (list, tuple)):
        return type(x)(_upcast(a) for a in x)
    if isinstance(x, dict):
        return {k: _upcast(v) for k, v in x.items()}
    return x


def _as_list(out: Any) -> list:
    return list(out) if isinstance(out, (list, tuple)) else [out]


def _divides(info: OpInfo, s: AxisStrategy, n: int) -> bool:
    for p, m in zip(s.ins + s.outs, info.inputs + info.outputs):
        if isinstance(p, Shard) and m is not None and m.shape[p.dim] % n:
            return False
    return True


def _split(t: torch.Tensor, p: Placement, n: int, gen: torch.Generator) -> list[torch.Tensor]:
    if isinstance(p, Shard):
        return [c.contiguous() for c in t.chunk(n, p.dim)]
    if not isinstance(p, Partial):
        return [t] * n
    if t.dtype == torch.bool:
        raise ValueError("Partial placement on a bool tensor")
    total = t * n if p.reduce_op == "avg" else t
    if not t.is_floating_point():
        parts = [torch.randint(-5, 6, t.shape, generator=gen, dtype=t.dtype) for _ in range(n - 1)]
        return parts + [total - sum(parts)]
    # Non-finite entries (log(0) in position buckets) cannot be split: the last part carries them whole.
    finite = torch.isfinite(t)
    scale = float(t[finite].abs().mean()) if finite.any() else 1.0
    parts = [torch.randn(t.shape, generator=gen, dtype=t.dtype) * (scale or 1.0) * finite for _ in range(n - 1)]
    return parts + [torch.where(finite, total - sum(parts), total)]


def _check_strategy(target, args, kwargs, info: OpInfo, s: AxisStrategy, n: int, ref: list,
                    gen: torch.Generator) -> str | None:
    split = [_split(t, p, n, gen) for t, p in zip(_tensors(args, kwargs), s.ins)]
    local_shapes = [None if m is None else local_shape(m.shape, (p,), (n,)) for m, p in zip(info.outputs, s.outs)]
    outs = []
    for r in range(n):
        mine = iter([parts[r] for parts in split])
        la, lk = _map_tensors((args, kwargs), lambda t: next(mine))
        op, la, lk = local_call(info, la, lk, local_shapes)
        outs.append(_as_list(op(*la, **lk)))
    for i, (p, want) in enumerate(zip(s.outs, ref)):
        if not isinstance(want, torch.Tensor):
            continue
        err = _compare([o[i] for o in outs], p, want)
        if err:
            return f"output {i}: {err}"
    return None


def _tensors(args, kwargs) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    _map_tensors((args, kwargs), lambda t: found.append(t) or t)
    return found


def _compare(parts: list[torch.Tensor], p: Placement, want: torch.Tensor) -> str | None:
    if isinstance(p, Shard):
        got = torch.cat(parts, p.dim)
    elif isinstance(p, Partial):
        got = sum(parts[1:], parts[0])
        if p.reduce_op == "avg":
            got = got / len(parts) if got.is_floating_point() else got // len(parts)
    else:
        for k, other in enumerate(parts[1:], 1):
            err = _close(other, parts[0])
            if err:
                return f"replicated output differs between rank 0 and rank {k}: {err}"
        got = parts[0]
    return _close(got, want)


def _close(got: torch.Tensor, want: torch.Tensor) -> str | None:
    if want.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):  # FP8 casts: bit for bit
        if got.shape != want.shape or got.dtype != want.dtype:
            return f"got {got.dtype}{list(got.shape)}, want {want.dtype}{list(want.shape)}"
        diff = int((got.view(torch.uint8) != want.view(torch.uint8)).sum())
        return f"{diff} of {want.numel()} FP8 values differ" if diff else None
    finite = want[torch.isfinite(want)] if want.is_floating_point() else None
    scale = float(finite.abs().max()) if finite is not None and finite.numel() else 1.0
    try:
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL * max(1.0, scale), equal_nan=True)
    except AssertionError as e:
        return " ".join(str(e).split())[:300]
    return None
