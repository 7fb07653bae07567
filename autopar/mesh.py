"""Mesh axes, the link kind behind each axis, and fake meshes for planning at any scale."""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh

LINK_KINDS = ("nvlink", "ib", "pcie", "loopback")
# A mesh axis with one of these names splits the model into pipeline stages, one per coordinate.
PIPELINE_AXIS_NAMES = ("pp", "pipe", "pipeline")


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

    @property
    def pipeline_axis(self) -> int | None:
        """The index of the axis named pp, pipe or pipeline (one at most), or None."""
        return pipeline_axis(self.axis_names)

    def to_json(self) -> dict:
        return {"axis_names": list(self.axis_names), "shape": list(self.shape), "links": list(self.links),
                "device_type": self.device_type}

    @classmethod
    def from_json(cls, d: dict) -> "MeshSpec":
        return cls(tuple(d["axis_names"]), tuple(d["shape"]), tuple(d["links"]), d.get("device_type", "cuda"))


# GPUs that share one NVLink domain: the 8 of an HGX/DGX A100, H100 or H200 node.
GPUS_PER_NODE = 8


def default_links(names: Sequence[str], shape: Sequence[int], device_type: str,
                  gpus_per_node: int = GPUS_PER_NODE) -> tuple[str, ...]:
    """CPU meshes talk over loopback. On GPUs, the innermost axes whose sizes multiply to at most one node's
    GPUs are NVLink (ranks are numbered node by node, so they stay inside a node) and the others InfiniBand:
    (8, 8) is (ib, nvlink), (4, 2) is (nvlink, nvlink), (2, 16) is (ib, ib)."""
    if device_type == "cpu":
        return tuple("loopback" for _ in names)
    links, inner = [], 1
    for size in reversed(tuple(shape)):
        inner *= int(size)
        links.append("nvlink" if inner <= gpus_per_node else "ib")
    return tuple(reversed(links))


def target_device_type(mesh: DeviceMesh, device: str | None = None) -> str:
    """The device type a plan for `mesh` targets: a real mesh runs where it is; a fake mesh (planning only)
    takes it from the Config's device when one is named ("cpu" -> cpu, a GPU -> cuda), else from fake_mesh."""
    fake = getattr(mesh, "_autopar_target_device", None)
    if fake is None:
        return mesh.device_type
    if device is not None:
        return "cpu" if device.lower() == "cpu" else (fake if fake != "cpu" else "cuda")
    return fake


def mesh_spec(mesh: DeviceMesh, links: dict[str, str] | None = None, device: str | None = None) -> MeshSpec:
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError("the mesh needs axis names: build it with mesh_dim_names=('dp', 'tp') or similar")
    shape = tuple(mesh.mesh.shape)
    dev = target_device_type(mesh, device)
    chosen = list(default_links(names, shape, dev))
    for axis, kind in (links or {}).items():
        if axis not in names:
            raise ValueError(f"links names axis {axis!r}, but the mesh axes are {list(names)}")
        if kind not in LINK_KINDS:
            raise ValueError(f"unknown link kind {kind!r} for axis {axis!r}; known: {', '.join(LINK_KINDS)}")
        chosen[names.index(axis)] = kind
    return MeshSpec(tuple(names), shape, tuple(chosen), dev)


def pipeline_axis(names: Sequence[str]) -> int | None:
    found = [i for i, n in enumerate(names) if n in PIPELINE_AXIS_NAMES]
    if len(found) > 1:
        raise ValueError(f"the mesh names {len(found)} pipeline axes {[names[i] for i in found]}; name one axis "
                         f"{' / '.join(PIPELINE_AXIS_NAMES)}")
    return found[0] if found else None


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
