"""User-facing configuration: frozen keyword-only dataclasses."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping


@dataclasses.dataclass(frozen=True, kw_only=True)
class SolverConfig:
    """Knobs of the integer program. `time_limit_s` is deterministic solver time, so plans are reproducible."""

    time_limit_s: float = 60.0
    backend: str = "highs"  # "highs" (MIP, default) or "cp-sat" (all-boolean)
    seed: int = 0
    workers: int = 1
    # Extra passes when the simulated peak memory exceeds the limit the ILP's linear estimate respected.
    memory_refinements: int = 3
    show_progress: bool = True
    # Shards of a tensor's innermost dim narrower than this many elements are not considered for compute
    # (None: 128 on GPU targets, where such shards fall below a tensor-core tile and a full memory
    # transaction and run far below the roofline the cost model assumes; 1 on CPU).
    min_inner_shard: int | None = None
    # Drop strategies of multi-input ops that only forward a pending reduction (add(P, P) -> P,
    # mul(P, R) -> P): they postpone a reduction by one op and roughly double the program's edge variables.
    prune_partial_inputs: bool = True


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """How to plan. Every field left as None is inferred from the mesh and the device.

    device: hardware table entry ("h100", "h200", "a100", "cpu"); None: "cpu" on a CPU mesh, else "h100". A fake
            mesh (autopar.fake_mesh) takes its device type from it: "cpu" plans a CPU mesh (loopback links, fp32).
    links: link kind per mesh axis name ("nvlink", "ib", "pcie", "loopback"); None: loopback on CPU; on GPUs the
           innermost axes whose sizes multiply to at most one node's GPUs (8) are NVLink, the others InfiniBand
           (autopar.mesh.default_links).
    memory_limit_gb: per-rank memory budget; defaults to the device's memory.
    pins: {fqn glob: placements tuple in mesh_dim_names order} fixing parameters (storage and use), or
          {"act:<block-relative node glob>": placements} fixing activations (e.g. sequence parallel recipes).
    input_placements: {input index: placements} fixing how inputs are split.
    mixed_precision: "bf16": the step is captured under autocast to bfloat16, so the generated program casts the
                     fp32 parameters (the master weights) to bf16 before matmuls (an FSDP weight is cast on its
                     shard, then gathered in bf16), runs autocast's fp32 ops (losses such as cross_entropy)
                     in fp32 and hands back fp32 gradients for an fp32 optimizer step. "fp32": no casts,
                     every op in the parameters' dtype. None (default): "bf16" on GPU meshes, "fp32" on CPU
                     meshes. The plan records it and is priced under it.
    sync_batch_norm: training batch norm is captured as per-channel sums (autopar/rules/sync_batch_norm.py), so
                     the planner may split its input over the batch and reduce the statistics across ranks
                     (global statistics, as SyncBatchNorm), shard its channels (exact locally) or replicate it,
                     whichever costs least; False keeps the fused kernel, which shards channels only.
    template_layers: plan() captures this many layers of each repeated stack and scales costs and memory to
                     the full depth, so planning time does not grow with depth (None: capture the whole model).
                     parallelize() always captures the whole model, since it runs every layer.
    microbatches: N splits every tensor input along dim 0 into N microbatches of equal size: the step runs the
                  forward and backward of each in turn (`pm.step(...)`), accumulating gradients locally, and runs
                  the gradient collectives once per step; activations are one microbatch's. "auto": the fewest
                  microbatches (a divisor of the batch) with which a plan fits the memory limit. None (default): 1.
                  The plan records it (`plan.microbatches`). With a pipeline, None and "auto" let the planner
                  choose the count with the schedule.
    pipeline: None (default): a mesh axis named pp, pipe or pipeline splits the model into pipeline stages
              (its size times the virtual stages per rank the schedule runs), other meshes get none. "auto": a
              mesh without such an axis may also get one, by factoring its outermost axis into pp x the rest.
    pipeline_schedule: a torch.distributed.pipelining schedule class name ("ScheduleGPipe", "Schedule1F1B",
                       "ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble") to run
                       instead of the one the planner finds fastest; None: the planner's choice.
    """

    device: str | None = None
    links: Mapping[str, str] | None = None
    memory_limit_gb: float | None = None
    pins: Mapping[str, tuple] | None = None
    input_placements: Mapping[int, tuple] | None = None
    solver_time_limit_s: float | None = None
    mixed_precision: str | None = None
    template_layers: int | None = 2
    sync_batch_norm: bool = True
    microbatches: int | str | None = None
    pipeline: str | None = None
    pipeline_schedule: str | None = None
    solver: SolverConfig = SolverConfig()

    def __post_init__(self):
        m = self.microbatches
        if not (m is None or m == "auto" or (isinstance(m, int) and not isinstance(m, bool) and m >= 1)):
            raise ValueError(f"Config(microbatches={m!r}): use a positive int (the number of microbatches each "
                             "global batch is split into along dim 0), 'auto', or None (one microbatch)")
        if self.pipeline_schedule is not None:
            from autopar.cost.pipeline import SCHEDULES

            if self.pipeline_schedule not in SCHEDULES:
                raise ValueError(f"Config(pipeline_schedule={self.pipeline_schedule!r}): use one of "
                                 f"{', '.join(SCHEDULES)}, or None for the planner's choice")
        if self.pipeline not in (None, "auto"):
            raise ValueError(f"Config(pipeline={self.pipeline!r}): use None (stages from a mesh axis named pp, "
                             "pipe or pipeline) or 'auto' (the planner may also factor the outermost mesh axis)")

    def to_json(self) -> dict:
        """Plain JSON data (placements as layout strings such as "S(0),R"); `Config.from_json` reads it back."""
        from autopar.layout import fmt_layout

        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "solver"}
        d["links"] = dict(self.links) if self.links else None
        d["pins"] = {k: fmt_layout(v) for k, v in self.pins.items()} if self.pins else None
        d["input_placements"] = ({str(k): fmt_layout(v) for k, v in self.input_placements.items()}
                                 if self.input_placements else None)
        d["solver"] = dataclasses.asdict(self.solver)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Config":
        from autopar.layout import parse_layout

        known = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in known and k != "solver"}
        if kw.get("pins"):
            kw["pins"] = {k: parse_layout(v) for k, v in kw["pins"].items()}
        if kw.get("input_placements"):
            kw["input_placements"] = {int(k): parse_layout(v) for k, v in kw["input_placements"].items()}
        solver_known = {f.name for f in dataclasses.fields(SolverConfig)}
        solver = SolverConfig(**{k: v for k, v in (d.get("solver") or {}).items() if k in solver_known})
        return cls(**kw, solver=solver)

    def with_(self, **changes: Any) -> "Config":
        return dataclasses.replace(self, **changes)

    def with_plan_precision(self, plan: Any) -> "Config":
        """This config, its mixed_precision taken from `plan` (None or a Plan) when left open (None)."""
        recorded = getattr(plan, "mixed_precision", None)
        if self.mixed_precision is None and recorded is not None:
            return self.with_(mixed_precision=recorded)
        return self
