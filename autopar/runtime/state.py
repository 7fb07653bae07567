"""Parameters and buffers as DTensors: taking this rank's shard of real weights, or allocating only the local
shards of a meta-device model and initializing them with the model's own `init_weights`.

Sharding follows DTensor's convention: mesh axes in order, a dim sharded on two axes split by the earlier
axis first (outer chunks), even shards only (the planner drops layouts that do not divide).
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

Layout = tuple[Placement, ...]


def local_shard(full: torch.Tensor, layout: Sequence[Placement], coords: Sequence[int],
                sizes: Sequence[int]) -> torch.Tensor:
    """This rank's piece of `full` under `layout` (a view; clone it to own the memory)."""
    x = full
    for p, c, n in zip(layout, coords, sizes):
        if isinstance(p, Shard):
            size = x.shape[p.dim]
            if size % n:
                raise ValueError(f"dim {p.dim} of size {size} does not split evenly into {n} shards")
            m = size // n
            x = x.narrow(p.dim, c * m, m)
        elif isinstance(p, Partial):
            raise ValueError("a stored tensor cannot be Partial")
    return x


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(stride))


def as_dtensor(local: torch.Tensor, mesh: DeviceMesh, layout: Layout, global_shape: Sequence[int]) -> DTensor:
    shape = torch.Size(global_shape)
    return DTensor.from_local(local, mesh, layout, run_check=False, shape=shape, stride=contiguous_stride(shape))


def mesh_coords(mesh: DeviceMesh) -> tuple[int, ...]:
    coords = mesh.get_coordinate()
    if coords is None:
        raise ValueError("this rank is not part of the mesh; build the mesh over every rank of the job")
    return tuple(int(c) for c in coords)


def mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    mod = getattr(torch, mesh.device_type)
    return torch.device(mesh.device_type, mod.current_device())


def owner(model: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    mod_path, _, name = fqn.rpartition(".")
    return (model.get_submodule(mod_path) if mod_path else model), name


def shard_real(full: torch.Tensor, mesh: DeviceMesh, layout: Layout) -> DTensor:
    """Every rank holds the same full tensor (same model, same seed): keep this rank's shard, no communication."""
    local = local_shard(full.detach(), layout, mesh_coords(mesh), tuple(mesh.mesh.shape))
    local = local.to(mesh_device(mesh), copy=True).contiguous()
    return as_dtensor(local, mesh, layout, full.shape)


def empty_shard(shape: Sequence[int], dtype: torch.dtype, mesh: DeviceMesh, layout: Layout) -> DTensor:
    from autopar.layout import local_shape

    local = torch.empty(local_shape(tuple(shape), layout, tuple(mesh.mesh.shape)), dtype=dtype,
                        device=mesh_device(mesh))
    if dtype.is_floating_point or dtype.is_complex:
        local.fill_(float("nan"))  # so a value init_weights never wrote is caught below
    return as_dtensor(local, mesh, layout, shape)


def init_meta(model: nn.Module, tensors: dict[str, tuple[str, DTensor]], aliases: dict[str, list[str]],
              seed: int | None, mesh: DeviceMesh) -> dict[str, DTensor]:
    """Run the model's initializer on local shards.

    `tensors`: fqn -> (kind 'param'|'buffer', empty DTensor). The DTensors are swapped into the model for
    the call (and swapped back after), under implicit replication, so `p.copy_(full_tensor)` keeps this
    rank's slice and `p.fill_(v)` fills it. Returns fqn -> initialized DTensor (a buffer the initializer
    reassigned is picked up and sharded).

    Where it cannot match a single-device init: an initializer drawing random numbers directly into a
    parameter (`nn.init.normal_(p)`) on CPU draws each shard from the local generator, so the values differ
    from an unsharded model with the same seed; draw the full tensor and copy it (as Llama.init_weights
    does) for identical values. A model without `init_weights` gets every submodule's `reset_parameters()`.
    """
    from torch.distributed.tensor.experimental import implicit_replication

    restore = []
    for fqn, (kind, dt) in tensors.items():
        for name in [fqn, *aliases.get(fqn, [])]:
            mod, attr = owner(model, name)
            table = mod._parameters if kind == "param" else mod._buffers
            restore.append((table, attr, table[attr]))
            table[attr] = nn.Parameter(dt, requires_grad=False) if kind == "param" else dt
    try:
        with torch.no_grad(), implicit_replication():
            init = getattr(model, "init_weights", None)
            if callable(init):
                init(seed) if seed is not None else init()
            else:
                warnings.warn(f"{type(model).__name__} is on the meta device and has no init_weights(seed); running "
                              "each submodule's reset_parameters() on the local shards (random values differ from "
                              "an unsharded init)", stacklevel=3)
                for m in model.modules():
                    if callable(getattr(m, "reset_parameters", None)):
                        m.reset_parameters()
        out = {}
        for fqn, (kind, dt) in tensors.items():
            mod, attr = owner(model, fqn)
            cur = (mod._parameters if kind == "param" else mod._buffers)[attr]
            cur = cur.data if isinstance(cur, nn.Parameter) else cur
            if isinstance(cur, DTensor):
                out[fqn] = cur
            elif isinstance(cur, torch.Tensor) and not cur.is_meta and tuple(cur.shape) == tuple(dt.shape):
                out[fqn] = shard_real(cur, mesh, dt.placements)
            else:
                out[fqn] = dt
    finally:
        for table, attr, old in reversed(restore):
            table[attr] = old
    for fqn, dt in out.items():
        loc = dt.to_local()
        if (loc.dtype.is_floating_point or loc.dtype.is_complex) and loc.numel() and torch.isnan(loc).any():
            raise ValueError(f"{fqn} is on the meta device and {type(model).__name__}'s initializer left it unset "
                             "(init_weights must write every parameter and buffer, e.g. recompute buffers built in "
                             "__init__); or build the model with real weights")
    return out


def load_state(model: nn.Module, program: Any, mesh: DeviceMesh, seed: int | None,
               aliases: dict[str, list[str]]) -> tuple[dict[str, DTensor], dict[str, DTensor]]:
    """The program's parameters and buffers as DTensors in its layouts: this rank's shard of the model's real
    tensors, or, for a model on the meta device, local shards initialized by its `init_weights` (weights the
    user gave win over the initializer)."""
    out: dict[str, tuple[str, DTensor]] = {}
    real: dict[str, torch.Tensor] = {}
    meta = False
    for kind, specs in (("param", program.params), ("buffer", program.buffers)):
        for spec in specs:
            t = model.get_parameter(spec.name) if kind == "param" else model.get_buffer(spec.name)
            if t.is_meta:
                meta = True
                out[spec.name] = (kind, empty_shard(t.shape, t.dtype, mesh, spec.layout))
            else:
                real[spec.name] = t
                out[spec.name] = (kind, shard_real(t, mesh, spec.layout))
    if meta:
        done = init_meta(model, out, aliases, seed, mesh)
        for fqn, t in real.items():
            done[fqn] = shard_real(t, mesh, out[fqn][1].placements)
    else:
        done = {fqn: dt for fqn, (_, dt) in out.items()}
    return ({s.name: done[s.name] for s in program.params}, {s.name: done[s.name] for s in program.buffers})


def placeholder_state(model: nn.Module, mesh: DeviceMesh,
                      skip: set[str] = frozenset()) -> tuple[dict[str, DTensor], dict[str, DTensor]]:
    """Every parameter and buffer of `model` (but those named in `skip`) as a replicated DTensor over its own
    storage (no copy; on the meta device for a meta model): what a ParallelModule that plans on its first call
    holds until then, so that an optimizer can be made over its parameters before the plan exists."""
    def wrap(t: torch.Tensor) -> DTensor:
        local = t.detach() if t.is_meta else t.detach().to(mesh_device(mesh))
        return as_dtensor(local, mesh, tuple(Replicate() for _ in mesh.mesh.shape), t.shape)

    params = {n: wrap(p) for n, p in model.named_parameters() if n not in skip}
    buffers = {n: wrap(b) for n, b in model.named_buffers() if n not in skip}
    return params, buffers


def non_persistent_buffers(model: nn.Module) -> set[str]:
    """FQNs of the buffers registered with persistent=False (left out of state_dict)."""
    out = set()
    for mod_name, mod in model.named_modules():
        for b in getattr(mod, "_non_persistent_buffers_set", ()):
            out.add(f"{mod_name}.{b}" if mod_name else b)
    return out


def numel(shape: Sequence[int]) -> int:
    return math.prod(int(s) for s in shape)
