"""Mesh axes, the link kind behind each axis, and fake meshes for planning at any scale."""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh

LINK_KINDS = ("nvlink", "ib", "pcie", "loopback")


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """What the compiler needs to know of a mesh: axis names, sizes and link kinds."""

    axis_names: tuple[str, ...]
    shape: tuple[int, ...]
    links: tuple[str, ...]
    device_type: str = "cuda"

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def axis_size(self, axis: str) -> int:
        return self.shape[self.axis_names.index(axis)]

    def to_json(self) -> dict:
        return {"axis_names": list(self.axis_names), "shape": list(self.shape), "links": list(self.links),
                "device_type": self.device_type}

    @classmethod
    def from_json(cls, d: dict) -> "MeshSpec":
        return cls(tuple(d["axis_names"]), tuple(d["shape"]), tuple(d["links"]), d.get("device_type", "cuda"))


def default_links(names: Sequence[str], shape: Sequence[int], device_type: str) -> tuple[str, ...]:
    """CPU meshes talk over loopback; on GPUs the innermost axis is NVLink, the rest InfiniBand."""
    if device_type == "cpu":
        return tuple("loopback" for _ in names)
    return tuple("nvlink" if i == len(names) - 1 else "ib" for i in range(len(names)))


def mesh_spec(mesh: DeviceMesh, links: dict[str, str] | None = None) -> MeshSpec:
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError("the mesh needs axis names: build it with mesh_dim_names=('dp', 'tp') or similar")
    shape = tuple(mesh.mesh.shape)
    dev = getattr(mesh, "_autopar_target_device", None) or mesh.device_type
    chosen = list(default_links(names, shape, dev))
    for axis, kind in (links or {}).items():
        if axis not in names:
            raise ValueError(f"links names axis {axis!r}, but the mesh axes are {list(names)}")
        if kind not in LINK_KINDS:
            raise ValueError(f"unknown link kind {kind!r} for axis {axis!r}; known: {', '.join(LINK_KINDS)}")
        chosen[names.index(axis)] = kind
    return MeshSpec(tuple(names), shape, tuple(chosen), dev)


def fake_mesh(shape: int | Sequence[int], names: str | Sequence[str], device_type: str = "cuda") -> DeviceMesh:
    """A DeviceMesh of any size for planning in one process; no process group is created or touched."""
    from autopar import _torch_compat

    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    names = (names,) if isinstance(names, str) else tuple(names)
    if len(shape) != len(names):
        raise ValueError(f"mesh shape {shape} has {len(shape)} axes but {len(names)} names {names}")
    if any(n < 1 for n in shape):
        raise ValueError(f"mesh shape {shape} must be positive")
    ranks = torch.arange(math.prod(shape)).view(shape)
    mesh = _torch_compat.device_mesh_without_backend(device_type, ranks, names)
    mesh._autopar_target_device = device_type
    return mesh
