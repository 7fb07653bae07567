"""Every private torch API autopar touches, in one place, so a torch upgrade breaks here and nowhere else."""
from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any, Callable, Iterator

import torch
import torch.fx.traceback as fx_traceback
from torch.distributed.device_mesh import DeviceMesh


def device_mesh_without_backend(device_type: str, ranks: torch.Tensor, names: tuple[str, ...]) -> DeviceMesh:
    """A DeviceMesh that never initializes a process group (for planning only)."""
    try:
        return DeviceMesh(device_type, ranks, mesh_dim_names=names, _init_backend=False, _rank=0)
    except TypeError:  # older torch without the _rank keyword
        return DeviceMesh(device_type, ranks, mesh_dim_names=names, _init_backend=False)


def fake_tensor_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def is_fake(t: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


@contextlib.contextmanager
def annotate_modules(root: torch.nn.Module, key: str = "autopar_module") -> Iterator[None]:
    """Tag every traced node (forward and backward) with the FQN of the module that produced it."""
    stack: list[Any] = []
    handles = []

    def pre(name):
        def hook(mod, args, kwargs=None):
            cm = fx_traceback.annotate({key: name})
            cm.__enter__()
            stack.append(cm)
        return hook

    def post(mod, args, out):
        if stack:
            _leave(stack.pop())

    for name, mod in root.named_modules():
        handles.append(mod.register_forward_pre_hook(pre(name)))
        handles.append(mod.register_forward_hook(post, always_call=True))
    try:
        with fx_traceback.preserve_node_meta():
            yield
    finally:
        for h in handles:
            h.remove()
        while stack:
            _leave(stack.pop())


def _leave(cm) -> None:
    """Exit an annotation. When tracing failed, a tracer's own meta context may already have reset the
    annotations on its way out; exiting must not then replace the user's error with a KeyError."""
    try:
        cm.__exit__(None, None, None)
    except KeyError:
        pass


def node_module(node: torch.fx.Node, key: str = "autopar_module") -> str | None:
    return (node.meta.get("custom") or {}).get(key)


def export_joint(stack: contextlib.ExitStack, module: torch.nn.Module, args: tuple, kwargs: dict | None,
                 decompositions: dict | None = None):
    """Joint forward+backward ATen graph with input/output descriptors (params, grads, tangents)."""
    from torch._functorch.aot_autograd import aot_export_joint_with_descriptors

    return aot_export_joint_with_descriptors(stack, module, args, kwargs, decompositions=decompositions)


@contextlib.contextmanager
def compiling() -> Iterator[None]:
    """`torch.compiler.is_compiling()` is True inside, as while torch.compile traces a model: libraries skip the
    data-dependent checks they skip under compilation (transformers' mask shortcuts and packed-sequence
    detection read tensor values otherwise)."""
    old = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = old


CHECKPOINT_KEY = "autopar_checkpoint"


@contextlib.contextmanager
def checkpoint_regions() -> Iterator[None]:
    """Trace `torch.utils.checkpoint.checkpoint` regions (reentrant or not, however the caller bound the function,
    e.g. transformers' gradient_checkpointing_enable) as plain forward code whose nodes carry
    `meta["custom"][CHECKPOINT_KEY]` = the region's number: a joint-graph trace would otherwise keep every
    activation, and codegen recomputes the tagged values in backward instead of saving them."""
    import torch.utils.checkpoint as ckpt

    counter = iter(range(1 << 30))

    def generator(fn, preserve_rng_state=True, context_fn=None, determinism_check=None, debug=False,
                  early_stop=True, *args, **kwargs):
        with fx_traceback.annotate({CHECKPOINT_KEY: next(counter)}), checkpoint_policy(context_fn):
            yield

    class Reentrant:
        @staticmethod
        def apply(function, preserve_rng_state, *args):
            with fx_traceback.annotate({CHECKPOINT_KEY: next(counter)}):
                return function(*args)

    saved = ckpt._checkpoint_without_reentrant_generator, ckpt.CheckpointFunction
    ckpt._checkpoint_without_reentrant_generator, ckpt.CheckpointFunction = generator, Reentrant
    try:
        yield
    finally:
        ckpt._checkpoint_without_reentrant_generator, ckpt.CheckpointFunction = saved


@contextlib.contextmanager
def saved_tensor_hooks_entered() -> Iterator[list[str]]:
    """Inside: the names of the saved-tensor hooks (`torch.autograd.graph.saved_tensors_hooks` and its subclasses:
    `save_on_cpu`, which transformers' `activation_checkpointing_enable(offload=True)` enters) that code enters,
    appended to the yielded list. A traced step never runs them: the generated program saves its own tensors."""
    import torch.autograd.graph as graph

    seen: list[str] = []
    enter = graph.saved_tensors_hooks.__enter__

    def recording(self):
        seen.append(type(self).__name__)
        return enter(self)

    graph.saved_tensors_hooks.__enter__ = recording
    try:
        yield seen
    finally:
        graph.saved_tensors_hooks.__enter__ = enter


@contextlib.contextmanager
def checkpoint_policy(context_fn: Callable[[], tuple] | None) -> Iterator[None]:
    """Inside a checkpointed region while it is traced: the forward context of the checkpoint's `context_fn`. For a
    selective policy (`torch.utils.checkpoint.create_selective_checkpoint_contexts`) that context, under tracing,
    records each op's policy on its nodes (`meta["recompute"]`, read by `checkpoint_saves`), as it does for
    torch.compile; autopar never runs the recompute context (codegen recomputes from the graph)."""
    if context_fn is None:
        yield
        return
    forward, _ = context_fn()
    with forward:
        yield


def checkpoint_saves(node: torch.fx.Node) -> bool:
    """Whether a selective checkpoint policy marked a traced op's output to be saved (MUST_SAVE or PREFER_SAVE)
    rather than recomputed."""
    from torch.utils.checkpoint import CheckpointPolicy

    return node.meta.get("recompute") in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)


def checkpointed_call(target: Any, args: tuple, kwargs: dict
                      ) -> tuple[torch.fx.GraphModule, tuple, Callable[[], tuple] | None] | None:
    """For a Dynamo graph's call of a checkpointed region (torch.utils.checkpoint, which Dynamo traces into one
    `tag_activation_checkpoint` call of the region's graph): (the region's GraphModule, its arguments, the
    checkpoint's `context_fn` or None: see checkpoint_policy); None for any other call. The checkpoint's other
    options are dropped."""
    from torch._higher_order_ops.wrap import tag_activation_checkpoint

    if target is not tag_activation_checkpoint:
        return None
    options, body_kwargs = tag_activation_checkpoint.divide_kwargs(kwargs)
    if body_kwargs:
        raise ValueError(f"a checkpointed region takes keyword arguments {sorted(body_kwargs)} in the compiled graph; "
                         "autopar runs checkpointed regions of positional arguments: pass them positionally")
    return args[0], tuple(args[1:]), options.get("context_fn") or checkpointed_call_policy(args[0])


def checkpointed_call_policy(region: torch.fx.GraphModule) -> Callable[[], tuple] | None:
    """The context_fn of a Dynamo graph's checkpointed region, which Dynamo keeps on the region's graph."""
    return region.meta.get("_checkpoint_context_fn")


def checkpoint_region(node: torch.fx.Node) -> int | None:
    """The checkpoint region a traced node was computed in (see checkpoint_regions), or None."""
    return (node.meta.get("custom") or {}).get(CHECKPOINT_KEY)


def descriptor_kind(desc: Any) -> tuple[str, Any]:
    """Classify an AOT input/output descriptor: ('param', fqn), ('buffer', fqn), ('input', idx), ('tangent', i),
    ('loss', idx), ('grad_param', fqn), ('grad_input', idx), ('mutated_buffer', fqn), ('mutated_input', idx),
    ('mutated_param', fqn) or ('other', desc)."""
    name = type(desc).__name__
    if name == "ParamAOTInput":
        return "param", desc.target
    if name == "BufferAOTInput":
        return "buffer", desc.target
    if name == "PlainAOTInput":
        return "input", desc.idx
    if name == "TangentAOTInput":
        return "tangent", desc.output
    if name == "PlainAOTOutput":
        return "loss", desc.idx
    if name == "GradAOTOutput":
        inner_kind, inner = descriptor_kind(desc.grad_of)
        return ("grad_param", inner) if inner_kind == "param" else ("grad_input", inner)
    if name == "InputMutationAOTOutput":  # the new value of an input the step mutates in place
        inner_kind, inner = descriptor_kind(desc.mutated_input)
        return f"mutated_{inner_kind}", inner
    return "other", desc


def functional_collectives():
    import torch.distributed._functional_collectives as fc

    return fc


def c10d_functional_ops():
    """The functional collective ops (`torch.ops._c10d_functional`: all_gather_into_tensor, all_reduce,
    reduce_scatter_tensor, all_to_all_single, wait_tensor), registered by importing their Python module."""
    functional_collectives()
    return torch.ops._c10d_functional


C10D_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd", "c10d", "_dtensor")


def op_namespace_and_name(target: Any) -> tuple[str | None, str | None]:
    """('_c10d_functional', 'all_reduce') for an OpOverload; (None, None) for anything else."""
    ns = getattr(target, "namespace", None)
    packet = getattr(target, "overloadpacket", None)
    return ns, getattr(packet, "__name__", None)


def group_name_of(mesh: DeviceMesh, axis: str) -> str:
    """The registered process-group name behind one mesh axis (what functional collectives take)."""
    return mesh.get_group(axis).group_name


def tree_leaves(tree: Any) -> list:
    """Leaves of nested args/kwargs in the order aot_autograd flattens them (its PlainAOTInput indices)."""
    import torch.utils._pytree as pytree

    return pytree.tree_leaves(tree)


def tree_flatten(tree: Any) -> tuple[list, Any]:
    """(leaves in tree_leaves order, the tree's structure; its str names the structure)."""
    import torch.utils._pytree as pytree

    return pytree.tree_flatten(tree)


def tree_unflatten(leaves: list, spec: Any) -> Any:
    """The inverse of tree_flatten."""
    import torch.utils._pytree as pytree

    return pytree.tree_unflatten(leaves, spec)


def dtensor_local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard without an autograd node (inside an autograd.Function)."""
    return t._local_tensor  # type: ignore[attr-defined]


def dtensor_like(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`local` wrapped as a DTensor with the spec (mesh, placements, global shape) of the DTensor `like`;
    no checks and no communication: the cheap way to hand back a gradient of `like`."""
    from torch.distributed.tensor import DTensor

    return DTensor(local, like._spec, requires_grad=False)  # type: ignore[attr-defined]


def flattened_group_name(mesh: DeviceMesh, axes: tuple[str, ...]) -> str:
    """The process group over several axes of `mesh` flattened into one (DeviceMesh._flatten, cached by the
    root mesh): a collective over it reduces over all those axes at once. Every rank must call it."""
    return mesh[axes]._flatten().get_group().group_name


def scaled_mm_op():
    """aten._scaled_mm (private): the FP8 GEMM, `(a, b, scale_a, scale_b, bias=None, scale_result=None,
    out_dtype=None, use_fast_accum=False)`, a row-major and b column-major; runs on CUDA (sm89+) and on CPU."""
    return torch.ops.aten._scaled_mm.default


@functools.lru_cache(maxsize=256)
def pipeline_schedule_order(schedule: str, pp: int, microbatches: int, stages_per_rank: int) -> tuple[tuple, ...]:
    """Per pipeline rank, the compute actions (stage index, "F" | "B" | "I" | "W", microbatch index) in the order
    the torch.distributed.pipelining schedule class `schedule` (e.g. "ScheduleInterleaved1F1B") runs them, built
    from the class itself with a stand-in stage (no process group), as torch's schedule visualizer does; the
    idle slots the class pads its order with are left out."""
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    cls = getattr(schedules, schedule)
    multi = issubclass(cls, schedules.PipelineScheduleMulti)
    ops = get_schedule_ops(cls, pp, microbatches, stages_per_rank if multi else None)
    return tuple(tuple((int(a.stage_index), a.computation_type.value, int(a.microbatch_index)) for a in rank
                       if a is not None and a.is_compute_op) for rank in ops)


def annotate(key: str, value: Any):
    """A context in which every traced node (and the backward nodes derived from it) carries
    `meta["custom"][key] = value` (what `annotate_modules` does per module)."""
    return fx_traceback.annotate({key: value})


def dynamo_module_path(node: torch.fx.Node) -> str | None:
    """The FQN, relative to the compiled frame's root object, of the innermost module a node of a Dynamo graph
    was traced in (from its `nn_module_stack`, e.g. "L['self'].layers[0].attention" -> "layers.0.attention");
    "" for the root itself, None when Dynamo recorded none."""
    import re

    # Modules Dynamo reached through a global (transformers wraps functions such as apply_rotary_pos_emb as a
    # module held by its Python module) are not the root's: the innermost one reached from the frame is.
    stack = [p for p, _ in (node.meta.get("nn_module_stack") or {}).values() if not str(p).startswith("G[")]
    if not stack:
        return None
    path = stack[-1]
    path = re.sub(r"^[LG]\[['\"][^'\"]*['\"]\]", "", str(path))
    path = re.sub(r"\._modules\[['\"]([^'\"]+)['\"]\]", r".\1", path)
    path = re.sub(r"\[['\"]?([^'\"\]]+)['\"]?\]", r".\1", path)
    return path.lstrip(".")


def is_compiled_module(mod: Any) -> bool:
    """A torch.compile wrapper (OptimizedModule), whose `_orig_mod` is the module itself."""
    from torch._dynamo.eval_frame import OptimizedModule

    return isinstance(mod, OptimizedModule)


def has_symbolic_shapes(value: Any) -> bool:
    """A SymInt/SymFloat, or a (fake) tensor with a symbolic size or stride: a graph Dynamo traced with dynamic
    shapes."""
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return True
    if isinstance(value, torch.Tensor):
        return any(isinstance(s, torch.SymInt) for s in (*value.shape, *value.stride()))
    return False


def _implicit_replication_callbacks():
    from torch.distributed.tensor import DTensor

    dispatcher = DTensor._op_dispatcher
    saved: list[bool] = []

    def start(*_: Any) -> None:
        saved.append(dispatcher._allow_implicit_replication)
        dispatcher._allow_implicit_replication = True

    def end(*_: Any) -> None:
        if saved:
            dispatcher._allow_implicit_replication = saved.pop()

    return start, end


_IMPLICIT_REPLICATION_CALLBACKS: list = []


def implicit_replication_in_dynamo() -> None:
    """While Dynamo compiles, plain tensors mixed with DTensors in one op count as replicated DTensors (DTensor's
    implicit replication), so a module whose parameters are DTensors can be traced again (new input shapes,
    grad mode) with plain inputs; outside Dynamo's compiles nothing changes. Idempotent and cheap, so callers
    repeat it: torch._dynamo.reset() clears Dynamo's compile callbacks."""
    import torch._dynamo

    if not _IMPLICIT_REPLICATION_CALLBACKS:
        _IMPLICIT_REPLICATION_CALLBACKS.extend(_implicit_replication_callbacks())
    start, end = _IMPLICIT_REPLICATION_CALLBACKS
    handler = torch._dynamo.callback_handler
    if start not in handler.start_callbacks:
        handler.register_start_callback(start)
        handler.register_end_callback(end)


def checkpointed_regions_in_dynamo() -> None:
    """Let Dynamo trace a checkpointed region (torch.utils.checkpoint, transformers' gradient_checkpointing_enable)
    whose forward has Python side effects (transformers' hub kernel layers set a context variable) into its
    graph, as one `tag_activation_checkpoint` call, instead of running the region eagerly. Dynamo refuses such
    a region because it cannot replay the side effects when its backward recomputes the forward; an autopar
    graph never replays Python code (the capture inlines the region, and its backward recomputes the region's
    tensor ops), so nothing is lost. Process-wide, as Dynamo's config is; a torch without the option keeps its
    own behaviour."""
    import torch._dynamo

    if hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True


@contextlib.contextmanager
def outside_dynamo() -> Iterator[None]:
    """Inside a torch.compile backend: no Dynamo tracing or compile context and no active fake mode, so a
    capture of its own (autopar.capture) makes and uses its own FakeTensorMode."""
    from torch._guards import compile_context, tracing
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), tracing(None), compile_context(None):
        yield


def dynamo_guards() -> Any:
    """The guards Dynamo is collecting for the frame it compiles (inside a backend call), or None."""
    from torch._guards import TracingContext

    ctx = TracingContext.try_get()
    return None if ctx is None else ctx.guards_context.dynamo_guards


def retarget_tensor_guards(guards: Any, replaced: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Make the guards Dynamo is about to build for tensors a backend replaced in the module (old -> new, keyed
    by id(old)) describe the new tensors. Dynamo builds a tensor's guard from the tensor it traced while that
    one is alive (a weak reference), else from the value its source reads now; a parameter also held
    elsewhere (an optimizer, a list) would give a guard that fails on the frame's own values."""
    import torch.utils.weak as torch_weak

    if guards is None:
        return
    for guard in guards:
        fn = guard.create_fn
        value = getattr(fn, "keywords", {}).get("value")
        if isinstance(value, torch_weak.TensorWeakRef):
            old = value()
            pair = replaced.get(id(old)) if old is not None else None
            if pair is not None and pair[0] is old:
                value.ref = weakref.ref(pair[1])


def inductor_compile(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
    """`gm` compiled by Inductor for these inputs (no Dynamo: usable where Dynamo is disabled, as inside a
    torch.compile backend's compiled function); called as `fn(*args)`."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs)


def dispatch_mode_base() -> type:
    """torch.utils._python_dispatch.TorchDispatchMode: the base class of a mode that sees every aten op."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def flattened_tensors(t: Any) -> list:
    """A tensor subclass (DTensor, a functional collective's AsyncCollectiveTensor) as the plain tensors holding
    its data; a plain tensor as itself."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not is_traceable_wrapper_subclass(t):
        return [t]
    names, _ = t.__tensor_flatten__()
    inner = [getattr(t, n) for n in names]
    return [x for v in inner if isinstance(v, torch.Tensor) for x in flattened_tensors(v)]
