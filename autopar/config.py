"""User-facing configuration: frozen keyword-only dataclasses."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping


@dataclasses.dataclass(frozen=True, kw_only=True)
class SolverConfig:
    """Knobs of the integer program. Its time limit is Config.solver_time_limit_s (the whole planning call)."""

    backend: str = "highs"  # "highs" (MIP, default) or "cp-sat" (all-boolean)
    seed: int = 0
    workers: int = 1
    # None (default): plan from the relaxation and its warm starts, and report how far from optimal the plan may
    # be (its gap and bound). A number: then search on until the plan is proven within that fraction of the
    # optimum (0: a proof of optimality); under a binding memory limit that proof can take many times as long.
    relative_gap: float | None = None
    show_progress: bool = True
    # Shards of a tensor's innermost dim narrower than this many elements are not considered for compute
    # (None: 128 on GPU targets, where such shards fall below a tensor-core tile and a full memory
    # transaction and run far below the roofline the cost model assumes; 1 on CPU).
    min_inner_shard: int | None = None
    # Drop strategies of multi-input ops that only forward a pending reduction (add(P, P) -> P,
    # mul(P, R) -> P): they postpone a reduction by one op and roughly double the program's edge variables.
    prune_partial_inputs: bool = True

    def __post_init__(self) -> None:
        if self.backend not in ("highs", "cp-sat"):
            raise ValueError(f"unknown solver backend {self.backend!r}; use SolverConfig(backend=...) with one of: "
                             "highs, cp-sat")
        if self.relative_gap is not None and not 0 <= self.relative_gap < 1:
            raise ValueError(f"SolverConfig(relative_gap={self.relative_gap}) must be at least 0 and below 1")


# Module FQN patterns (fnmatch) whose matmuls never run in FP8 by default: embeddings, the output head (a top-level
# `output` or any `lm_head`) and MoE routers/gates, where FP8's 3-bit mantissa costs accuracy a model feels most.
DEFAULT_FP8_EXCLUDE = ("*embed*", "output", "lm_head", "*.lm_head", "*router*", "gate", "*.gate")
OUTPUT_MODES = ("sharded", "global")
INNER_COMPILERS = ("inductor", "eager")
FP8_MODES = ("off", "auto", "all")
FP8_SCALINGS = ("tensorwise", "rowwise")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fp8Config:
    """FP8 matmuls (see docs/user_guide.md, "FP8 matmuls").

    mode: "off" (default: every matmul in the compute dtype), "auto" (the integer program picks, per matmul and
          per layout, bf16 or an FP8 variant by cost), "all" (every eligible matmul in FP8; for numerics tests).
    exclude: module FQN patterns (fnmatch; a pattern may also name the block-relative form `layers.*.x`) whose
             matmuls stay in the compute dtype.
    scaling: the FP8 variants offered: "tensorwise" (one scale per operand; with "fp8_all_gather", also the
             variant that gathers FSDP-sharded weights in FP8) and "rowwise" (one scale per row along the
             contraction; bf16 output only).
    fp8_all_gather: offer the tensorwise variant that casts an FSDP-sharded weight to FP8 before its all-gather
                    (half the bytes of a bf16 gather; one scalar max all-reduce for the shared scale).
    on_nonfinite: what a training step with an inf or nan gradient does when the program runs FP8 matmuls:
                  "raise" (autopar.errors.Fp8NonFiniteError) or "zero" (the gradients are zeroed and
                  ParallelModule.fp8_nonfinite_steps counts it; the optimizer step stays the caller's).
    """

    mode: str = "off"
    exclude: tuple[str, ...] = DEFAULT_FP8_EXCLUDE
    scaling: tuple[str, ...] = FP8_SCALINGS
    fp8_all_gather: bool = True
    on_nonfinite: str = "raise"

    def __post_init__(self):
        if self.mode not in FP8_MODES:
            raise ValueError(f"Fp8Config(mode={self.mode!r}): use one of {', '.join(map(repr, FP8_MODES))}")
        scaling = (self.scaling,) if isinstance(self.scaling, str) else tuple(self.scaling)
        bad = [s for s in scaling if s not in FP8_SCALINGS]
        if bad or not scaling:
            raise ValueError(f"Fp8Config(scaling={self.scaling!r}): give one or more of "
                             f"{', '.join(map(repr, FP8_SCALINGS))}")
        if self.on_nonfinite not in ("raise", "zero"):
            raise ValueError(f"Fp8Config(on_nonfinite={self.on_nonfinite!r}): use 'raise' or 'zero'")
        exclude = (self.exclude,) if isinstance(self.exclude, str) else tuple(self.exclude or ())
        object.__setattr__(self, "scaling", scaling)
        object.__setattr__(self, "exclude", exclude)

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def to_json(self) -> dict:
        return {"mode": self.mode, "exclude": list(self.exclude), "scaling": list(self.scaling),
                "fp8_all_gather": self.fp8_all_gather, "on_nonfinite": self.on_nonfinite}

    @classmethod
    def from_json(cls, d: "dict | str | None") -> "Fp8Config":
        if d is None or isinstance(d, str):
            return cls(mode=d or "off")
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k in known})


def resolve_fp8(fp8: "str | Fp8Config | None") -> Fp8Config:
    """Config.fp8 as an Fp8Config: a mode string ("off", "auto", "all") takes the default exclusions and
    scalings."""
    if isinstance(fp8, Fp8Config):
        return fp8
    if fp8 is None or isinstance(fp8, str):
        if fp8 not in (None, *FP8_MODES):
            raise ValueError(f"Config(fp8={fp8!r}): use 'off', 'auto', 'all' or an Fp8Config(...)")
        return Fp8Config(mode=fp8 or "off")
    raise ValueError(f"Config(fp8=...) takes 'off', 'auto', 'all' or an Fp8Config, got {type(fp8).__name__}")


RECOMPUTE_MODES = ("auto", "off", "selective", "full")


def _partial_recompute(mode) -> bool:
    """Whether `mode` is "full/r" or "full/r/selective" with r a positive integer."""
    parts = mode.split("/") if isinstance(mode, str) else []
    return (len(parts) in (2, 3) and parts[0] == "full" and parts[1].isdigit() and int(parts[1]) > 0
            and parts[2:] in ([], ["selective"]))


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
    solver_time_limit_s: wall-clock seconds for the whole planning call (capture included). When it passes,
                     plan() returns the best plan that fits, with a warning, or raises SolverTimeout if none was
                     found yet. None: no limit. Plans are reproducible whenever planning ends inside it.
    sync_batch_norm: training batch norm is captured as per-channel sums (autopar/rules/sync_batch_norm.py), so
                     the planner may split its input over the batch and reduce the statistics across ranks
                     (global statistics, as SyncBatchNorm), shard its channels (exact locally) or replicate it,
                     whichever costs least; False keeps the fused kernel, which shards channels only.
    fp8: "off" (default), "auto", "all", or an Fp8Config (exclusions, scalings, FP8 all-gather, inf/nan policy):
         which matmuls (each linear's forward GEMM and its two backward GEMMs) run in FP8 through
         torch._scaled_mm, E4M3 activations and weights, E5M2 gradients, dynamic scaling. "auto" lets the
         integer program choose per matmul by cost on the local sharded shapes; "all" runs every eligible one in
         FP8 (on a device without FP8, such as "cpu", priced at the bf16 rate, with a warning). FP8 changes
         numerics, so it is opt-in; on FP8 hardware a plan made with "off" says what "auto" would gain.
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
    recompute: activation recomputation of the repeated layers (autopar/recompute.py). "auto" (default): the
               integer program chooses per layer stack, with the placements, whether its layers keep their
               activations for backward, recompute the cheap memory-heavy ops ("selective": norms, activation
               functions, attention internals; matmul and fused-attention outputs are kept) or recompute the
               whole layer from its input ("full"), pricing the recompute time on the local shapes and counting
               the saved bytes in the memory rows; or, in between, the first r layers in full and the others
               keeping ("full/r") or selective ("full/r/selective"), r about a quarter, half or three quarters of
               the stack. "off": never; "selective" / "full": every layer stack so; "full/r" and
               "full/r/selective": every stack so, with that r (Megatron's recompute_num_layers).
               Layers the model checkpoints itself (torch.utils.checkpoint, transformers'
               gradient_checkpointing_enable) are recomputed in full whatever this says.
    outputs: what the torch.compile backend (autopar.backend) returns for a graph's outputs other than the loss:
             "sharded" (default) DTensors in their planned layouts (no gather of logits every step); "global"
             full tensors, each output pinned replicated in the plan so the planner prices its gather.
             `parallelize` returns the loss alone and ignores it.
    inner_compiler: how the torch.compile backend runs each rank's forward and backward graphs: "inductor"
                    (default) compiles them with Inductor on their first calls (Triton kernels on GPU, C++ on
                    CPU); "eager" runs them as fx graphs. `parallelize(compile=True)` is its switch there.
    """

    device: str | None = None
    links: Mapping[str, str] | None = None
    memory_limit_gb: float | None = None
    pins: Mapping[str, tuple] | None = None
    input_placements: Mapping[int, tuple] | None = None
    solver_time_limit_s: float | None = 300.0
    mixed_precision: str | None = None
    template_layers: int | None = 2
    sync_batch_norm: bool = True
    fp8: "str | Fp8Config" = "off"
    microbatches: int | str | None = None
    pipeline: str | None = None
    pipeline_schedule: str | None = None
    recompute: str = "auto"
    outputs: str = "sharded"
    inner_compiler: str = "inductor"
    solver: SolverConfig = SolverConfig()

    @property
    def fp8_config(self) -> Fp8Config:
        return resolve_fp8(self.fp8)

    def __post_init__(self):
        resolve_fp8(self.fp8)  # a bad value fails here, where the user wrote it
        m = self.microbatches
        if not (m is None or m == "auto" or (isinstance(m, int) and not isinstance(m, bool) and m >= 1)):
            raise ValueError(f"Config(microbatches={m!r}): use a positive int (the number of microbatches each "
                             "global batch is split into along dim 0), 'auto', or None (one microbatch)")
        if self.pipeline_schedule is not None:
            from autopar.cost.pipeline import SCHEDULES

            if self.pipeline_schedule not in SCHEDULES:
                raise ValueError(f"Config(pipeline_schedule={self.pipeline_schedule!r}): use one of "
                                 f"{', '.join(SCHEDULES)}, or None for the planner's choice")
        if self.recompute not in RECOMPUTE_MODES and not _partial_recompute(self.recompute):
            raise ValueError(f"Config(recompute={self.recompute!r}): use 'auto' (the planner decides per layer "
                             "stack), 'off', 'selective', 'full', or 'full/r' / 'full/r/selective' (the first r "
                             "layers of each stack in full, the others keeping or selective)")
        if self.outputs not in OUTPUT_MODES:
            raise ValueError(f"Config(outputs={self.outputs!r}): use 'sharded' (DTensors in their planned layouts) "
                             "or 'global' (full tensors, gathered as the plan prices it)")
        if self.inner_compiler not in INNER_COMPILERS:
            raise ValueError(f"Config(inner_compiler={self.inner_compiler!r}): use 'inductor' (the rank's graphs "
                             "compiled by Inductor) or 'eager' (run as fx graphs)")
        if self.pipeline not in (None, "auto"):
            raise ValueError(f"Config(pipeline={self.pipeline!r}): use None (stages from a mesh axis named pp, "
                             "pipe or pipeline) or 'auto' (the planner may also factor the outermost mesh axis)")

    def to_json(self) -> dict:
        """Plain JSON data (placements as layout strings such as "S(0),R"); `Config.from_json` reads it back."""
        from autopar.layout import fmt_layout

        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("solver", "fp8")}
        fp8 = self.fp8_config
        d["fp8"] = fp8.mode if fp8 == Fp8Config(mode=fp8.mode) else fp8.to_json()
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
        if isinstance(kw.get("fp8"), dict):
            kw["fp8"] = Fp8Config.from_json(kw["fp8"])
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
