"""The Plan: plain data saying, per node and parameter, which layout the solver chose and what it costs.

Keyed by stable node names and parameter FQNs (block-relative, `layers.*.`, for repeated layers), never by
live fx nodes, so a plan can be saved, edited, loaded and applied to a fresh capture of the same model.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from typing import TYPE_CHECKING, Any, Sequence

from torch.distributed.tensor import Placement

from autopar.layout import fmt_layout, parse_layout
from autopar.mesh import MeshSpec

if TYPE_CHECKING:
    from autopar.model_spec import ModelSpec

FORMAT_VERSION = 1


@dataclasses.dataclass
class NodePlan:
    """The chosen strategy of one node: input layouts (one per tensor input; None for non-tensors), output
    layouts, its compute time under that strategy, and the runner-up alternatives for explain().

    variant: how a matmul runs ("" as captured; "fp8_tensorwise", "fp8_rowwise", "fp8_tensorwise_ag", see
    autopar.strategy). variant_costs: for a matmul that may run in FP8, seconds per step of each variant on the
    chosen layout ({"bf16": ..., "fp8 tensorwise": ..., "fp8 rowwise": ...}), whichever the plan chose."""

    op: str
    ins: list[tuple[Placement, ...] | None]
    outs: list[tuple[Placement, ...]]
    compute_s: float = 0.0
    count: float = 1.0
    alternatives: list[dict] = dataclasses.field(default_factory=list)
    variant: str = ""
    variant_costs: dict[str, float] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        self.compute_s = _r(self.compute_s)  # as the file keeps it, so a loaded plan equals this one

    def to_json(self) -> dict:
        d = {"op": self.op, "ins": [fmt_layout(i) if i is not None else None for i in self.ins],
             "outs": [fmt_layout(o) for o in self.outs], "compute_s": self.compute_s, "count": self.count,
             "alternatives": self.alternatives}
        if self.variant:
            d["variant"] = self.variant
        if self.variant_costs:
            d["variant_costs"] = self.variant_costs
        return d

    @classmethod
    def from_json(cls, d: dict) -> "NodePlan":
        return cls(d["op"], [parse_layout(i) if i is not None else None for i in d["ins"]],
                   [parse_layout(o) for o in d["outs"]], d.get("compute_s", 0.0), d.get("count", 1.0),
                   d.get("alternatives", []), d.get("variant", ""), d.get("variant_costs", {}))


@dataclasses.dataclass
class Transition:
    """A layout change on a graph edge and the collectives that implement it."""

    src: str
    dst: str
    arg: int
    src_layout: tuple[Placement, ...]
    dst_layout: tuple[Placement, ...]
    steps: str
    cost_s: float
    count: float = 1.0
    kind: str = "activation"  # activation | param | grad

    def __post_init__(self):
        self.cost_s = _r(self.cost_s)

    def to_json(self) -> dict:
        return {"src": self.src, "dst": self.dst, "arg": self.arg, "from": fmt_layout(self.src_layout),
                "to": fmt_layout(self.dst_layout), "steps": self.steps, "cost_s": self.cost_s,
                "count": self.count, "kind": self.kind}

    @classmethod
    def from_json(cls, d: dict) -> "Transition":
        return cls(d["src"], d["dst"], d["arg"], parse_layout(d["from"]), parse_layout(d["to"]), d["steps"],
                   d["cost_s"], d.get("count", 1.0), d.get("kind", "activation"))


def _r(x: float) -> float:
    return float(f"{x:.6g}")


@dataclasses.dataclass
class PipelinePlan:
    """Pipeline stages: the mesh axis they run over (`ranks` coordinates), `stages` stages in all
    (`virtual_stages` per rank), the torch.distributed.pipelining schedule class that runs them, the
    microbatches per step; per stage the pipeline rank it runs on, its layers [start, end) of the repeated stack
    and its modules by name (the first stage also holds what precedes the layers, the last what follows them),
    and its estimated time per microbatch; the simulated step (time, bubble fraction: the share of the ranks'
    time spent idle, memory per pipeline rank, the activations' transfer time between stages), every schedule
    priced for comparison, and the timeline as [lane, label, start, end] records for a Gantt chart."""

    axis: str
    ranks: int
    stages: int
    virtual_stages: int
    schedule: str
    microbatches: int
    stage_ranks: list[int]
    stage_layers: list[list[int]]
    stage_modules: list[list[str]]
    bubble_fraction: float
    step_time_s: float
    stage_time_s: list[float]
    send_s: float
    memory_per_rank: list[int]
    schedules: list[dict] = dataclasses.field(default_factory=list)
    timeline: list[list] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        self.bubble_fraction, self.step_time_s, self.send_s = _r(self.bubble_fraction), _r(self.step_time_s), \
            _r(self.send_s)
        self.stage_time_s = [_r(t) for t in self.stage_time_s]
        self.schedules = [{k: (_r(v) if isinstance(v, float) else v) for k, v in d.items()} for d in self.schedules]
        self.timeline = [[str(a), str(b), _r(c), _r(d)] for a, b, c, d in self.timeline]
        self.stage_layers = [list(x) for x in self.stage_layers]

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "PipelinePlan":
        return cls(**d)

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)

    def items(self):
        return self.to_json().items()


@dataclasses.dataclass
class Plan:
    mesh: MeshSpec
    device: str
    nodes: dict[str, NodePlan]
    params: dict[str, tuple[Placement, ...]]
    inputs: list[tuple[Placement, ...] | None]
    transitions: list[Transition]
    estimated_step_time: float
    peak_memory_per_rank: int
    cost_breakdown: dict[str, float]
    memory_breakdown: dict[str, int]
    fingerprint: str
    blocks: dict[str, int] = dataclasses.field(default_factory=dict)
    # Stacks whose layers start past index 0 (autopar.capture.Block.first): prefix -> index of the first layer.
    block_first: dict[str, int] = dataclasses.field(default_factory=dict)
    param_numel: dict[str, int] = dataclasses.field(default_factory=dict)
    memory_limit: int = 0
    solver_stats: dict[str, Any] = dataclasses.field(default_factory=dict)
    version: int = FORMAT_VERSION
    # The Config.mixed_precision the graph was captured and priced under ("bf16" or "fp32"; None: not recorded).
    mixed_precision: str | None = None
    # How the model was named (autopar.model_spec.ModelSpec.to_json()) and the Config it was planned with
    # (Config.to_json()), so the file alone can rebuild, compare and re-generate it.
    model: dict | None = None
    config: dict | None = None
    # How each training-mode batch norm computes its statistics: module FQN -> "global over <axes>" (input split
    # over the batch on those axes, per-channel sums all-reduced, as SyncBatchNorm), "channels split" or "local"
    # (replicated); see Config.sync_batch_norm.
    batch_norms: dict[str, str] = dataclasses.field(default_factory=dict)
    # Seconds per planning stage (capture and each pass): reported, never part of the digest.
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    # The simulated step for plots: communication bytes per rank per axis, and the first events of the compute
    # and communication streams as [stream, label, start_s, end_s].
    comm_bytes: dict[str, float] = dataclasses.field(default_factory=dict)
    timeline: list[list] = dataclasses.field(default_factory=list)
    # FP8 matmuls (passes/fp8_variants.summary): {"mode", "fp8_gemms", "eligible_gemms" (runs per step),
    # "compute_saved_s", and with FP8 off on FP8 hardware "auto_would_save_s"}; empty when no matmul may run in FP8.
    fp8: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Microbatches per step (Config.microbatches): each global batch is split along dim 0 into this many; the
    # graph was captured at one microbatch's shapes and the figures are for the whole step.
    microbatches: int = 1
    # Pipeline stages (over a mesh axis named pp), None without.
    pipeline: PipelinePlan | None = None
    # Activation recomputation per repeated layer stack (autopar/recompute.py): prefix -> {"variant": "keep",
    # "selective" or "full", "by": "solver", "config" or "model" (the model checkpoints it itself), "time_s":
    # seconds per step the recomputation adds, "saved_bytes": activation bytes per rank it saves at the peak,
    # and "layers": r where only the stack's first r layers recompute in full, "others": "selective" where the
    # rest recompute selectively, "model_layers": how many of its layers the model checkpoints itself where it
    # checkpoints some only}.
    recompute: dict[str, dict] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        # The solver's clock readings are timings, not part of what the plan decides.
        for k in [k for k in self.solver_stats if _volatile(k)]:
            self.timings.setdefault(f"solver_{k}", self.solver_stats[k])
        self.solver_stats = {k: v for k, v in self.solver_stats.items() if not _volatile(k)}
        # Figures as the file keeps them (6 significant digits), so Plan.from_json(p.to_json()) == p.
        self.estimated_step_time = _r(self.estimated_step_time)
        self.cost_breakdown = {k: _r(v) for k, v in self.cost_breakdown.items()}
        self.timings = {k: _r(v) for k, v in self.timings.items()}
        self.comm_bytes = {k: _r(v) for k, v in self.comm_bytes.items()}
        self.timeline = [[str(a), str(b), _r(c), _r(d)] for a, b, c, d in self.timeline]

    # --- lookup -----------------------------------------------------------------------------------------
    def key(self, name: str) -> str:
        """Plan key of a node name or parameter FQN: block indices become `*`."""
        from autopar.capture import stack_pattern

        for prefix in self.blocks:
            name = re.sub(rf"(^|[/.]){stack_pattern(prefix, self.block_first.get(prefix, 0))}(?=[./]|$)",
                          rf"\g<1>{prefix}.*", name)
        return name

    def _layers(self, prefix: str) -> range:
        """Indices of a stack's layers in the model."""
        first = self.block_first.get(prefix, 0)
        return range(first, first + self.blocks[prefix])

    def node(self, name: str) -> NodePlan:
        return self.nodes[self.key(name)]

    def param_layout(self, fqn: str) -> tuple[Placement, ...]:
        return self.params[self.key(fqn)]

    def param_placements(self, fqns: list[str] | None = None) -> dict[str, tuple[Placement, ...]]:
        """{fqn: placements in mesh_dim_names order}; with the model's FQNs, block patterns are expanded."""
        if fqns is None:
            fqns = self._expanded_fqns()
        return {f: self.param_layout(f) for f in fqns}

    def _expanded_fqns(self) -> list[str]:
        out = []
        for key in self.params:
            m = next(((p, c) for p, c in self.blocks.items() if f"{p}.*." in key), None)
            if m is None:
                out.append(key)
            else:
                out.extend(key.replace(f"{m[0]}.*.", f"{m[0]}.{i}.") for i in self._layers(m[0]))
        return out

    def fp8_modules(self) -> list[str]:
        """FQNs of the modules whose matmuls run in FP8 (one per layer for a repeated block), sorted."""
        from autopar.inspect.fmt import fp8_nodes, node_module

        out = set()
        for key in fp8_nodes(self):
            mod = node_module(key)
            m = next(((p, c) for p, c in self.blocks.items() if mod.startswith(f"{p}.*.")), None)
            out.update([mod] if m is None else (mod.replace(f"{m[0]}.*.", f"{m[0]}.{i}.", 1)
                                                for i in self._layers(m[0])))
        return sorted(out)

    @property
    def techniques(self) -> frozenset[str]:
        from autopar.inspect import techniques

        return techniques(self)

    @property
    def model_spec(self) -> "ModelSpec | None":
        """How the plan's model was named (autopar.model_spec.ModelSpec), or None when not recorded."""
        from autopar.model_spec import ModelSpec

        return ModelSpec.from_json(self.model) if self.model else None

    # --- thin views (implemented in autopar.inspect and autopar.recipes) ------------------------------------
    def __str__(self) -> str:
        from autopar.inspect import format_plan

        return format_plan(self)

    def summary(self) -> str:
        from autopar.inspect import format_summary

        return format_summary(self)

    def explain(self, name: str) -> str:
        from autopar.inspect import explain

        return explain(self, name)

    def diff(self, other: "Plan") -> str:
        from autopar.inspect import diff

        return diff(self, other)

    def compare(self, model: Any = None, example_inputs: Sequence[Any] | None = None, *,
                recipes: Sequence[str] = ("ddp", "fsdp", "megatron", "fsdp+tp"), example_kwargs: dict | None = None,
                loss_fn: Any = None):
        """This plan beside hand-written recipes under the same cost model and config (as `autopar compare`).
        Without `model`, the model is rebuilt from the plan's model spec (plans made on the command line);
        a plan made in Python from a live model needs it again: `plan.compare(model, example_inputs)`."""
        from autopar.recipes import compare_plan

        return compare_plan(self, model, example_inputs, recipes=tuple(recipes), example_kwargs=example_kwargs,
                            loss_fn=loss_fn)

    def report(self, path: str, png_dir: str | None = None):
        """Write the self-contained HTML report (plots embedded; PNG copies in png_dir)."""
        from autopar.inspect import write_report

        return write_report(self, path, png_dir=png_dir)

    # --- serialization ------------------------------------------------------------------------------------
    def to_json(self, timings: bool = True) -> str:
        """The plan as JSON text; `timings=False` leaves out how long planning took, so two plans of the same
        inputs give the same bytes."""
        d = {
            "format": "autopar.plan", "version": self.version, "mesh": self.mesh.to_json(), "device": self.device,
            "fingerprint": self.fingerprint, "mixed_precision": self.mixed_precision, "blocks": self.blocks,
            "estimated_step_time": self.estimated_step_time, "peak_memory_per_rank": self.peak_memory_per_rank,
            "memory_limit": self.memory_limit,
            "cost_breakdown": dict(sorted(self.cost_breakdown.items())),
            "memory_breakdown": dict(sorted(self.memory_breakdown.items())),
            "params": {k: fmt_layout(v) for k, v in sorted(self.params.items())},
            "param_numel": dict(sorted(self.param_numel.items())),
            "inputs": [fmt_layout(i) if i is not None else None for i in self.inputs],
            "nodes": {k: v.to_json() for k, v in sorted(self.nodes.items())},
            "transitions": [t.to_json() for t in self.transitions],
            "solver": dict(sorted(self.solver_stats.items())),
            "model": self.model, "config": self.config, "batch_norms": dict(sorted(self.batch_norms.items())),
            "timings": dict(sorted(self.timings.items())) if timings else {},
            "comm_bytes": dict(sorted(self.comm_bytes.items())), "timeline": self.timeline,
            "microbatches": self.microbatches,
            "pipeline": self.pipeline.to_json() if self.pipeline is not None else None,
        }
        if self.block_first:
            d["block_first"] = dict(sorted(self.block_first.items()))
        if self.fp8:
            d["fp8"] = dict(sorted(self.fp8.items()))
        if self.recompute:
            d["recompute"] = {k: dict(sorted(v.items())) for k, v in sorted(self.recompute.items())}
        return json.dumps(d, indent=1, sort_keys=False)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        from autopar.errors import PlanMismatchError

        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanMismatchError(f"the plan file is not valid JSON ({e}); save it again with plan.to_json()") from e
        if not isinstance(d, dict) or d.get("format") != "autopar.plan":
            raise PlanMismatchError("this is not an autopar plan file (no 'format': 'autopar.plan' field)")
        if d.get("version") != FORMAT_VERSION:
            raise PlanMismatchError(f"plan format version {d.get('version')} is not supported (this autopar reads "
                                    f"version {FORMAT_VERSION}); re-plan with autopar.plan(...)")
        try:
            return cls(
                mesh=MeshSpec.from_json(d["mesh"]), device=d["device"],
                nodes={k: NodePlan.from_json(v) for k, v in d["nodes"].items()},
                params={k: parse_layout(v) for k, v in d["params"].items()},
                inputs=[parse_layout(i) if i is not None else None for i in d["inputs"]],
                transitions=[Transition.from_json(t) for t in d["transitions"]],
                estimated_step_time=d["estimated_step_time"], peak_memory_per_rank=d["peak_memory_per_rank"],
                cost_breakdown=d["cost_breakdown"], memory_breakdown=d["memory_breakdown"],
                fingerprint=d["fingerprint"], blocks=d.get("blocks", {}),
                block_first=d.get("block_first", {}), param_numel=d.get("param_numel", {}),
                memory_limit=d.get("memory_limit", 0), solver_stats=d.get("solver", {}), version=d["version"],
                mixed_precision=d.get("mixed_precision"), model=d.get("model"), config=d.get("config"),
                batch_norms=d.get("batch_norms", {}),
                timings=d.get("timings", {}), comm_bytes=d.get("comm_bytes", {}), timeline=d.get("timeline", []),
                fp8=d.get("fp8", {}), microbatches=int(d.get("microbatches", 1)),
                pipeline=PipelinePlan.from_json(d["pipeline"]) if d.get("pipeline") else None,
                recompute=_recompute_from_json(d.get("recompute", {})))
        except (KeyError, TypeError, ValueError) as e:
            raise PlanMismatchError(f"the plan file is corrupt or incomplete ({type(e).__name__}: {e}); "
                                    "re-plan or restore the file") from e

    def recomputed_stacks(self) -> list[str]:
        """The layer stacks whose activations backward recomputes (any variant but "keep", or some layers the
        model checkpoints itself)."""
        return [p for p, d in sorted(self.recompute.items())
                if d.get("variant", "keep") != "keep" or d.get("model_layers")]

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path: str) -> "Plan":
        with open(path) as f:
            return cls.from_json(f.read())

    def digest(self) -> str:
        """A hash of what the plan decides and estimates, leaving out how long planning took: equal digests,
        same plan."""
        return hashlib.sha256(self.to_json(timings=False).encode()).hexdigest()[:16]


def _recompute_from_json(d: dict) -> dict[str, dict]:
    from autopar.recompute import VARIANTS

    for prefix, v in d.items():
        if not isinstance(v, dict) or v.get("variant") not in VARIANTS:
            raise ValueError(f"recompute entry of {prefix!r} must be a dict whose variant is one of {VARIANTS}, "
                             f"got {v!r}")
        layers = v.get("layers")
        if layers is not None and (v["variant"] != "full" or not isinstance(layers, int) or layers < 1):
            raise ValueError(f"recompute entry of {prefix!r}: 'layers' (the first layers recomputed) must be a "
                             f"positive integer with variant 'full', got {v!r}")
        if v.get("others", "keep") not in ("keep", "selective") or (layers is None and "others" in v):
            raise ValueError(f"recompute entry of {prefix!r}: 'others' (what the layers after the first "
                             f"'layers' do) must be 'keep' or 'selective', with 'layers', got {v!r}")
    return {k: dict(v) for k, v in d.items()}


# Solver statistics that read the planning machine's clock: kept in `timings` (as solver_<name>).
_VOLATILE = {"seconds", "build_seconds", "solve_seconds", "capture_seconds", "wall_time"}


def _volatile(key: str) -> bool:
    return key in _VOLATILE or key.endswith("_seconds")
