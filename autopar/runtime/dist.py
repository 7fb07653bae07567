"""The job around a program: the world and the mesh, this rank's process groups (RankSpec), and agreement
across ranks on one plan and one dropout seed."""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from autopar.errors import PlanMismatchError
from autopar.plan import Plan
from autopar.program import RankSpec, flat_combinations
from autopar.runtime.state import mesh_coords


def world() -> tuple[int, int]:
    """(world size, rank); (1, 0) without an initialized process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def check_mesh(mesh: DeviceMesh) -> None:
    """A named, real DeviceMesh over every rank of an initialized job, or a ValueError saying what to change."""
    if mesh.mesh_dim_names is None:
        raise ValueError("the mesh needs axis names: init_device_mesh(..., mesh_dim_names=('dp', 'tp'))")
    if getattr(mesh, "_autopar_target_device", None) is not None:
        raise ValueError("parallelize needs a real DeviceMesh over the job's ranks; a fake mesh only plans "
                         "(use autopar.plan, and autopar.program(plan, rank) to read what a rank would run)")
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("torch.distributed is not initialized: launch with torchrun and call "
                         "dist.init_process_group before building the mesh")
    size, _ = world()
    if mesh.size() != size:
        raise ValueError(f"the mesh has {mesh.size()} ranks {dict(zip(mesh.mesh_dim_names, mesh.mesh.shape))} but "
                         f"the job has {size}; build the mesh over every rank (init_device_mesh with a shape whose "
                         "product is the world size)")


def rank_spec(mesh: DeviceMesh) -> RankSpec:
    """This rank's coordinates and the process group behind each axis of a real mesh, plus a flattened group
    over every combination of two or more axes (redistribute.Step.flat: a collective over several axes runs
    once on it). Creating a group is collective: every rank calls this, in the same order."""
    from autopar import _torch_compat as compat

    names = tuple(mesh.mesh_dim_names)
    groups = tuple(compat.group_name_of(mesh, n) for n in names)
    flat = tuple((axes, compat.flattened_group_name(mesh, tuple(names[a] for a in axes)))
                 for axes in flat_combinations(len(names)))
    return RankSpec(names, tuple(int(s) for s in mesh.mesh.shape), mesh_coords(mesh), groups, mesh.device_type,
                    flat)


def _all_ranks_ok(size: int, error: str | None) -> None:
    """Raise the same PlanMismatchError on every rank when any rank found a problem (so none is left waiting
    in a collective the others never reach)."""
    errors: list[Any] = [None] * size
    dist.all_gather_object(errors, error)
    bad = [(r, e) for r, e in enumerate(errors) if e is not None]
    if bad:
        ranks = [r for r, _ in bad]
        raise PlanMismatchError(f"ranks {ranks}: {bad[0][1]}" if len(ranks) < size else bad[0][1])


def agree_on_plan(make: Callable[[], Plan], check: Callable[[Plan], None] | None, given: Plan | None,
                  graph_id: str) -> Plan:
    """The one plan every rank runs. Each rank checks `given` (when there is one) with `check`; rank 0 then
    sends `given`, or the plan `make()` returns, to every rank, which checks that it arrived intact and that
    rank 0 captured the same graph (`graph_id`, the capture's fingerprint)."""
    size, rank = world()
    if size == 1:
        if given is None:
            return make()
        if check is not None:
            check(given)
        return given
    error = None
    if given is not None and check is not None:
        try:
            check(given)
        except PlanMismatchError as e:
            error = str(e)
    _all_ranks_ok(size, error)
    msg: list[Any] = [None]
    mine = given
    if rank == 0:
        try:
            mine = given if given is not None else make()
            msg = [("ok", mine.to_json(), mine.digest(), graph_id)]
        except Exception as e:  # noqa: BLE001 - the other ranks must not wait forever
            dist.broadcast_object_list([("error", f"{type(e).__name__}: {e}", None, None)], src=0)
            raise
    dist.broadcast_object_list(msg, src=0)
    status, text, digest, graph0 = msg[0]
    if status != "ok":
        raise RuntimeError(f"planning failed on rank 0: {text}")
    got = Plan.from_json(text) if rank != 0 else mine
    error = None
    if got.digest() != digest:
        error = f"the plan rank 0 sent arrived with digest {got.digest()}, not {digest}"
    elif given is not None and given.digest() != digest:
        error = "each rank must pass the same plan= (this one differs from rank 0's)"
    elif graph_id != graph0:
        error = ("the graph captured here differs from rank 0's (model, example inputs or loss differ across "
                 "ranks); every rank must build the same model and pass the same example inputs")
    _all_ranks_ok(size, error)
    return got


def agree_on_seed(seed: int | None) -> int:
    """The base seed of dropout masks, the same on every rank: `seed`, or rank 0's torch.initial_seed()."""
    if seed is not None:
        return int(seed)
    value = [torch.initial_seed()]
    if world()[0] > 1:
        dist.broadcast_object_list(value, src=0)
    return int(value[0])
