"""Hand-written parallelism recipes (DDP, FSDP, HSDP, Megatron TP, FSDP+TP) as pins, priced by the same cost model
as the solver's plan so the two can be compared.

A recipe is a function `(param_fqns, mesh_spec, **options) -> {"pins": ..., "input_placements": ...}`, ready for
`config.with_(**recipe(...))`. `param_fqns` is a list of FQNs or a {fqn: shape} dict; with shapes, sharded dims
are chosen to divide evenly. Pins are fnmatch globs with block indices collapsed (`layers.*.attention.wq.weight`).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Mapping, Sequence

from torch.distributed.tensor import Placement, Replicate, Shard

from autopar.errors import AutoparError, InfeasibleMemoryError

R = Replicate()
# Axis names that mean "not a data axis"; every other axis of the mesh carries the batch.
TENSOR_AXIS_NAMES = ("tp", "tensor", "mp", "model", "tensor_parallel")
OTHER_AXIS_NAMES = ("pp", "pipe", "pipeline", "cp", "context", "ep", "expert")
# Llama / torchtitan and Hugging Face names of the projections Megatron splits by output (colwise) or by
# input (rowwise) features. nn.Linear weights are (out, in): colwise shards dim 0, rowwise dim 1.
COLWISE = ("wq", "wk", "wv", "w1", "w3", "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROWWISE = ("wo", "w2", "o_proj", "down_proj")

Params = Sequence[str] | Mapping[str, Sequence[int]]


class RecipeError(AutoparError):
    """A recipe does not apply to this model or mesh (axis missing, no matching parameter names)."""


# --- mesh helpers -------------------------------------------------------------------------------------------

def tensor_axis(mesh: Any) -> str:
    """The axis Megatron splits over: one named like tp, else the innermost axis (usually NVLink)."""
    named = [a for a in mesh.axis_names if a.lower() in TENSOR_AXIS_NAMES]
    if len(named) > 1:
        raise RecipeError(f"the mesh has several tensor-parallel axes {named}; name only one of them tp")
    return named[0] if named else mesh.axis_names[-1]


def data_axes(mesh: Any, exclude: Sequence[str] = ()) -> list[str]:
    """Axes that split the batch: all but tensor/pipeline/context/expert axes and `exclude`."""
    skip = set(TENSOR_AXIS_NAMES + OTHER_AXIS_NAMES) | set(exclude)
    return [a for a in mesh.axis_names if a.lower() not in skip and a not in exclude]


def _layout(mesh: Any, per_axis: Mapping[str, Placement]) -> tuple:
    return tuple(per_axis.get(a, R) for a in mesh.axis_names)


def _inputs(mesh: Any, axes: Sequence[str], n_inputs: int) -> dict[int, tuple]:
    lay = tuple(Shard(0) if a in axes else R for a in mesh.axis_names)
    return {i: lay for i in range(n_inputs)}


def glob_of(fqn: str) -> str:
    """`layers.3.attention.wq.weight` -> `layers.*.attention.wq.weight`: one pin per repeated parameter."""
    return re.sub(r"(?<=\.)\d+(?=\.)", "*", fqn)


def _shapes(params: Params) -> dict[str, tuple[int, ...] | None]:
    if isinstance(params, Mapping):
        return {glob_of(k): tuple(v) for k, v in params.items()}
    return {glob_of(k): None for k in params}


def _shard_dim(shape: tuple[int, ...] | None, ways: int, avoid: int | None = None) -> int | None:
    """Dim 0 if it splits evenly `ways` ways (as FSDP shards), else the largest dim that does; None if none does."""
    if shape is None:
        return 0 if avoid != 0 else 1
    dims = sorted((d for d in range(len(shape)) if d != avoid and shape[d] % ways == 0 and shape[d] >= ways),
                  key=lambda d: (d != 0, -shape[d]))
    return dims[0] if dims else None


def _tp_role(fqn: str) -> str | None:
    parts = fqn.split(".")
    owner = parts[-2] if len(parts) >= 2 else ""
    if owner in COLWISE:
        return "colwise"
    if owner in ROWWISE:
        return "rowwise" if parts[-1] == "weight" else None  # a rowwise bias is added after the reduction
    return None


def _ways(mesh: Any, axes: Sequence[str]) -> int:
    n = 1
    for a in axes:
        n *= mesh.axis_size(a)
    return n


# --- recipes --------------------------------------------------------------------------------------------------

def ddp(params: Params, mesh: Any, *, axes: Sequence[str] | None = None, n_inputs: int = 1,
        pin_activations: bool = True) -> dict:
    """DistributedDataParallel: every parameter replicated, the batch split over the data axes."""
    axes = list(axes) if axes is not None else data_axes(mesh)
    _need(axes, "ddp")
    pins = {k: _layout(mesh, {}) for k in _shapes(params)}
    if pin_activations:
        pins.update(_batch_matmuls(mesh, axes))
    return {"pins": pins, "input_placements": _inputs(mesh, axes, n_inputs)}


def _batch_matmuls(mesh: Any, axes: Sequence[str]) -> dict[str, tuple]:
    # Data parallelism computes every forward matmul on the local batch; without this pin the solver may
    # gather a small batch and compute replicated, which is not what the recipe does.
    return {"act:*/fwd/*mm*": _layout(mesh, {a: Shard(0) for a in axes})}


def fsdp(params: Params, mesh: Any, *, axes: Sequence[str] | None = None, n_inputs: int = 1,
         pin_activations: bool = True) -> dict:
    """ZeRO-3 / FSDP: every parameter sharded on its largest evenly divisible dim over the data axes."""
    axes = list(axes) if axes is not None else data_axes(mesh)
    _need(axes, "fsdp")
    ways = _ways(mesh, axes)
    pins = {}
    for k, shape in _shapes(params).items():
        d = _shard_dim(shape, ways)
        pins[k] = _layout(mesh, {a: Shard(d) for a in axes} if d is not None else {})
    if pin_activations:
        pins.update(_batch_matmuls(mesh, axes))
    return {"pins": pins, "input_placements": _inputs(mesh, axes, n_inputs)}


def hsdp(params: Params, mesh: Any, *, replicate: str | None = None, shard: str | None = None,
         n_inputs: int = 1, pin_activations: bool = True) -> dict:
    """Hybrid sharded data parallel: replicate over one data axis (across nodes), shard over another."""
    axes = data_axes(mesh)
    if replicate is None or shard is None:
        if len(axes) < 2:
            raise RecipeError(f"hsdp needs two data axes (replicate, shard); the mesh has {list(mesh.axis_names)}"
                              " with data axes " + (", ".join(axes) or "none"))
        replicate, shard = replicate or axes[0], shard or axes[1]
    for a in (replicate, shard):
        if a not in mesh.axis_names:
            raise RecipeError(f"hsdp: axis {a!r} is not in the mesh {list(mesh.axis_names)}")
    out = fsdp(params, mesh, axes=[shard], n_inputs=n_inputs, pin_activations=False)
    out["input_placements"] = _inputs(mesh, [replicate, shard], n_inputs)
    if pin_activations:
        out["pins"].update(_batch_matmuls(mesh, [replicate, shard]))
    return out


def megatron(params: Params, mesh: Any, *, tp: str | None = None, axes: Sequence[str] | None = None,
             sequence_parallel: bool = False, n_inputs: int = 1, pin_activations: bool = True) -> dict:
    """Megatron-LM tensor parallelism over the tp axis: wq/wk/wv/w1/w3 column-parallel Shard(0), wo/w2 row-parallel
    Shard(1), embeddings, output and norms replicated; data parallel (replicated params) over the other axes.
    With `sequence_parallel`, norm and residual activations are split on the sequence dim over tp.
    `pin_activations` also fixes the forward matmul outputs (column-parallel: split on features; row-parallel:
    partial sums), so the solver cannot quietly gather the weights instead."""
    tp = tp or tensor_axis(mesh)
    axes = list(axes) if axes is not None else data_axes(mesh, exclude=[tp])
    pins = {}
    n_tp = 0
    for k, shape in _shapes(params).items():
        role = _tp_role(k)
        dim = {"colwise": 0, "rowwise": 1}.get(role)
        if dim is not None and shape is not None and (dim >= len(shape) or shape[dim] % mesh.axis_size(tp)):
            raise RecipeError(f"megatron: {k} of shape {list(shape)} does not split {mesh.axis_size(tp)} ways on "
                              f"dim {dim}; use a smaller {tp} axis")
        n_tp += dim is not None
        pins[k] = _layout(mesh, {tp: Shard(dim)} if dim is not None else {})
    if not n_tp:
        raise RecipeError("megatron: no Llama-style projections (wq/wk/wv/wo, w1/w2/w3 or q_proj/.../down_proj) "
                          "found among the parameters")
    acts = {}
    if sequence_parallel:
        acts.update(_sp_pins(mesh, tp, axes, _block_prefixes(pins)))
    if pin_activations:
        acts.update(_tp_matmuls(mesh, tp, axes, pins))
    pins.update(acts)
    return {"pins": pins, "input_placements": _inputs(mesh, axes, n_inputs)}


def _tp_matmuls(mesh: Any, tp: str, axes: Sequence[str], pins: Mapping[str, tuple]) -> dict[str, tuple]:
    from torch.distributed.tensor import Partial

    out = {}
    batch = {a: Shard(0) for a in axes}
    for k in pins:
        role = _tp_role(k)
        if role is None or not k.endswith(".weight"):
            continue
        module = k.rsplit(".", 1)[0].replace("*", "[*]")  # `[*]`: the literal `*` of block-relative keys
        out[f"act:{module}/fwd/*mm*"] = _layout(mesh, {**batch, tp: Shard(1) if role == "colwise" else Partial()})
    out.update(_batch_matmuls(mesh, axes) if axes else {})
    return out


def _sp_pins(mesh: Any, tp: str, axes: Sequence[str], prefixes: Sequence[str]) -> dict[str, tuple]:
    # (batch, seq, dim) activations of norms and of the residual adds of each block: batch over data axes, seq
    # over tp. `[*]` matches the literal `*` of block-relative keys, so attention-internal adds stay free.
    lay = _layout(mesh, {**{a: Shard(0) for a in axes}, tp: Shard(1)})
    pins = {"act:*norm/fwd/*": lay}
    pins.update({f"act:{p}.[*]/fwd/add*": lay for p in prefixes})
    return pins


def _block_prefixes(pins: Mapping[str, Any]) -> list[str]:
    return sorted({k.split(".*.", 1)[0] for k in pins if ".*." in k and not k.startswith("act:")})


def fsdp_tp(params: Params, mesh: Any, *, tp: str | None = None, axes: Sequence[str] | None = None,
            sequence_parallel: bool = False, n_inputs: int = 1, pin_activations: bool = True) -> dict:
    """FSDP over the data axes on top of Megatron TP: each tensor-split weight is also sharded over the data axes
    on its other dim; replicated ones on their largest divisible dim."""
    tp = tp or tensor_axis(mesh)
    axes = list(axes) if axes is not None else data_axes(mesh, exclude=[tp])
    _need(axes, "fsdp+tp")
    out = megatron(params, mesh, tp=tp, axes=axes, sequence_parallel=sequence_parallel, n_inputs=n_inputs,
                   pin_activations=pin_activations)
    shapes = _shapes(params)
    ways = _ways(mesh, axes)
    for k, lay in out["pins"].items():
        if k.startswith("act:"):
            continue
        t = lay[mesh.axis_names.index(tp)]
        used = t.dim if isinstance(t, Shard) else None
        d = _shard_dim(shapes.get(k), ways, avoid=used)
        if d is not None:
            out["pins"][k] = tuple(Shard(d) if a in axes else p for a, p in zip(mesh.axis_names, lay))
    return out


def _need(axes: Sequence[str], name: str) -> None:
    if not axes:
        raise RecipeError(f"{name} needs a data axis; the mesh has only tensor/pipeline axes")


RECIPES: dict[str, Callable[..., dict]] = {
    "ddp": ddp, "fsdp": fsdp, "hsdp": hsdp, "megatron": megatron,
    "megatron+sp": lambda p, m, **kw: megatron(p, m, sequence_parallel=True, **kw),
    "fsdp+tp": fsdp_tp,
    "fsdp+tp+sp": lambda p, m, **kw: fsdp_tp(p, m, sequence_parallel=True, **kw),
}


def recipe(name: str) -> Callable[..., dict]:
    try:
        return RECIPES[name]
    except KeyError:
        raise RecipeError(f"unknown recipe {name!r}; known: {', '.join(RECIPES)}") from None


# --- comparison ----------------------------------------------------------------------------------------------

@dataclasses.dataclass
class CompareRow:
    name: str
    plan: Any = None  # the Plan, None when the recipe could not run
    reason: str = ""  # why there is no plan, or a note (e.g. the memory it would need)
    fits: bool | None = None
    ratio: float | None = None  # step time over the solver plan's

    @property
    def step_time(self) -> float | None:
        return self.plan.estimated_step_time if self.plan is not None else None

    @property
    def exposed_comm(self) -> float | None:
        return self.plan.cost_breakdown.get("exposed_comm_s") if self.plan is not None else None

    @property
    def peak_memory(self) -> int | None:
        return self.plan.peak_memory_per_rank if self.plan is not None else None


@dataclasses.dataclass
class CompareResult:
    rows: list[CompareRow]
    memory_limit: int

    def row(self, name: str) -> CompareRow:
        return next(r for r in self.rows if r.name == name)

    @property
    def plans(self) -> dict[str, Any]:
        return {r.name: r.plan for r in self.rows if r.plan is not None}

    def table(self, width: int = 110) -> str:
        from autopar.inspect import compare_table

        return compare_table(self, width)

    def __str__(self) -> str:
        return self.table()


def compare_plans(plan: Any, recipe_plans: Mapping[str, Any], *, memory_limit: int | None = None,
                  solver_name: str = "autopar") -> CompareResult:
    """Rows for the solver's plan and each recipe's plan (or, in place of a plan, the reason it could not run)."""
    limit = memory_limit or plan.memory_limit
    rows = [CompareRow(solver_name, plan)]
    for name, p in recipe_plans.items():
        rows.append(p if isinstance(p, CompareRow) else CompareRow(name, None, str(p)) if isinstance(p, str)
                    else CompareRow(name, p))
    for r in rows:
        if r.plan is None:
            continue
        r.fits = r.plan.peak_memory_per_rank <= limit if limit else True
        if plan.estimated_step_time:
            r.ratio = r.plan.estimated_step_time / plan.estimated_step_time
        if not r.fits and not r.reason:
            r.reason = f"needs {r.plan.peak_memory_per_rank / 2**30:.1f} GiB per rank, limit {limit / 2**30:.1f} GiB"
    return CompareResult(rows, int(limit or 0))


def compare(model: Any, mesh: Any, example_inputs: Sequence[Any], *, loss_fn: Callable | None = None,
            config: Any = None, recipes: Sequence[str] = ("ddp", "fsdp", "megatron", "fsdp+tp"), plan: Any = None,
            example_kwargs: dict | None = None, progress: Callable[[str], None] | None = None) -> CompareResult:
    """Plan `model` with each recipe's pins under the same cost model and compare with the solver's plan
    (planned here unless given). A recipe that cannot run becomes a row with the reason."""
    import autopar
    from autopar.config import Config

    config = config or Config()
    config = config.with_plan_precision(plan)  # recipes priced in the plan's precision
    if plan is None:
        _say(progress, "planning with the solver")
        # The caller's progress display is live; a second one inside autopar.plan would clash with it.
        plan = autopar.plan(model, mesh, example_inputs, example_kwargs=example_kwargs, loss_fn=loss_fn,
                            config=_quiet(config) if progress else config)
    results: dict[str, Any] = {}
    for name in recipes:
        _say(progress, f"planning recipe {name}")
        results[name] = _run_recipe(name, model, mesh, example_inputs, example_kwargs, loss_fn, config,
                                    plan.memory_limit)
    return compare_plans(plan, results, memory_limit=plan.memory_limit)


def compare_plan(plan: Any, model: Any = None, example_inputs: Sequence[Any] | None = None, *,
                 recipes: Sequence[str] = ("ddp", "fsdp", "megatron", "fsdp+tp"), example_kwargs: dict | None = None,
                 loss_fn: Callable | None = None) -> CompareResult:
    """`plan.compare()`: the plan beside recipes on its own mesh and config. The model is rebuilt from the
    plan's model spec unless given (a plan made in Python from a live model needs it)."""
    from autopar.config import Config
    from autopar.mesh import fake_mesh
    from autopar.model_spec import ModelSpec

    if model is None:
        built = (plan.model_spec or ModelSpec("python", "an unrecorded model")).build()
        model, example_inputs = built.model, built.inputs
        loss_fn = loss_fn or built.loss_fn
        example_kwargs = example_kwargs if example_kwargs is not None else built.kwargs
    elif example_inputs is None:
        raise RecipeError("plan.compare(model, example_inputs): give the example inputs the plan was made with")
    config = Config.from_json(plan.config) if plan.config else Config(device=plan.device)
    config = config.with_(device=plan.device, links=dict(zip(plan.mesh.axis_names, plan.mesh.links)))
    mesh = fake_mesh(plan.mesh.shape, plan.mesh.axis_names, plan.mesh.device_type)
    return compare(model, mesh, example_inputs, loss_fn=loss_fn, config=config, recipes=recipes, plan=plan,
                   example_kwargs=example_kwargs)


def plan_recipe(name: str, model: Any, mesh: Any, example_inputs: Sequence[Any], *, loss_fn: Callable | None = None,
                config: Any = None, example_kwargs: dict | None = None, quiet: bool = False) -> Any:
    """autopar.plan with a recipe's pins. When the recipe's activation pins do not fit the model's graph (other op
    names or shapes), plans with its weight pins alone and says so in `plan.solver_stats["recipe_note"]`."""
    import autopar
    from autopar.config import Config
    from autopar.mesh import mesh_spec

    config = config or Config()
    config = _quiet(config) if quiet else config
    spec = mesh_spec(mesh, dict(config.links) if config.links else None, config.device)
    # remove_duplicate=False: a tied weight (GPT-2 lm_head = wte) may be captured under either name.
    shapes = {k: tuple(p.shape) for k, p in model.named_parameters(remove_duplicate=False)}
    tensors = [x for x in example_inputs if hasattr(x, "shape")]
    batch = next((x.shape[0] for x in tensors if x.dim() > 0), None)

    def run(acts: bool):
        pinned = config.with_(**_recipe_config(name, shapes, spec, len(tensors), batch, acts))
        return autopar.plan(model, mesh, example_inputs, example_kwargs=example_kwargs, loss_fn=loss_fn,
                            config=pinned)

    notes = []
    try:
        p = run(True)
    except ValueError as e:
        if "pin 'act:" not in str(e):
            raise
        p = run(False)
        notes.append("weights pinned only (activation pins did not apply to this model)")
    if name in ("ddp", "fsdp") and batch and batch % spec.size:
        notes.append(f"batch {batch} does not split over all {spec.size} ranks, so only "
                     f"{','.join(data_axes(spec))} carries it")
    p.solver_stats["recipe"] = name
    if notes:
        p.solver_stats["recipe_note"] = "; ".join(notes)
    return p


def _run_recipe(name, model, mesh, inputs, kwargs, loss_fn, config, limit: int) -> CompareRow:
    args = dict(loss_fn=loss_fn, example_kwargs=kwargs, quiet=True)
    try:
        try:
            p = plan_recipe(name, model, mesh, inputs, config=config, **args)
        except InfeasibleMemoryError:
            # Price it without the bound, to say how much memory the recipe would need.
            p = plan_recipe(name, model, mesh, inputs, config=config.with_(memory_limit_gb=1e9), **args)
            p.memory_limit = limit
    except ValueError as e:  # includes RecipeError and every AutoparError
        return CompareRow(name, None, _one_line(e))
    return CompareRow(name, p, p.solver_stats.get("recipe_note", ""))


def _recipe_config(name: str, shapes: dict, spec: Any, n_inputs: int, batch: int | None, acts: bool) -> dict:
    fn = recipe(name)
    if name in ("ddp", "fsdp") and batch and batch % spec.size == 0:
        # Pure data parallelism uses the whole mesh when the batch splits over every rank.
        return fn(shapes, spec, axes=list(spec.axis_names), n_inputs=n_inputs, pin_activations=acts)
    out = fn(shapes, spec, n_inputs=n_inputs, pin_activations=acts)
    ways = 1
    for a, p in zip(spec.axis_names, out["input_placements"].get(0, ())):
        ways *= spec.axis_size(a) if isinstance(p, Shard) else 1
    if batch and batch % ways:
        raise RecipeError(f"{name}: batch {batch} does not split {ways} ways over the data axes")
    return out


def _quiet(config: Any) -> Any:
    return config.with_(solver=dataclasses.replace(config.solver, show_progress=False))


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def _say(progress: Callable[[str], None] | None, msg: str) -> None:
    if progress is not None:
        progress(msg)


__all__ = ["ddp", "fsdp", "hsdp", "megatron", "fsdp_tp", "RECIPES", "recipe", "plan_recipe", "compare", "compare_plans",
           "compare_plan",
           "CompareResult", "CompareRow", "RecipeError", "tensor_axis", "data_axes", "glob_of"]
