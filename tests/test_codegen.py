"""Generated per-rank programs, read without running them: which collectives, on which axis, at which shapes."""
from __future__ import annotations

import dataclasses

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard

import autopar
from autopar.codegen import CodegenError, RankSpec, collectives, generate
from autopar.compiler import compile_plan
from autopar.redistribute import plan_steps
from autopar.codegen.collectives import checked_steps, collective_kind, steps_valid
from autopar.codegen.grad_sync import ALONE_GRAD
from autopar.config import Config, SolverConfig
from autopar.layout import local_shape
from autopar.models.llama import LLAMA3_8B, LLAMA_SMALL, LLAMA_TINY, Llama, cross_entropy_loss
from autopar.plan import Plan

R = Replicate()
QUIET = SolverConfig(show_progress=False)


class MLP(nn.Module):
    def __init__(self, d_in: int, hidden: int, d_out: int):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, d_out)

    def forward(self, x, y):
        return self.fc2(F.silu(self.fc1(x)))


def mse(out, x, y):
    return ((out - y) ** 2).mean()


def program(model, inputs, loss_fn, mesh, rank: RankSpec, **config):
    """Plan on the full graph and generate one rank's program."""
    cfg = Config(**{"solver": QUIET, "template_layers": None, **config})
    comp = compile_plan(model, mesh, inputs, loss_fn=loss_fn, config=cfg)
    return comp.plan, comp.captured, comp.program(rank)


def _mlp(d_in, hidden, d_out, batch):
    with torch.device("meta"):
        model = MLP(d_in, hidden, d_out)
    return model, (torch.zeros(batch, d_in), torch.zeros(batch, d_out))


def test_megatron_mlp_forward_has_one_all_reduce_on_tp():
    model, inputs = _mlp(1024, 8192, 1024, 64)
    rank = RankSpec.fake(("tp",), (4,), (1,))
    pins = {"fc1.*": (Shard(0),), "fc2.weight": (Shard(1),), "fc2.bias": (R,)}
    plan, _, prog = program(model, inputs, mse, autopar.fake_mesh(4, "tp"), rank, device="h100", pins=pins,
                            input_placements={0: (R,), 1: (R,)})
    assert collectives(prog.forward, rank) == [("all_reduce", "tp")], prog.code()
    # Column then row parallel: every gradient is already in its parameter's layout, the input needs none.
    assert collectives(prog.backward, rank) == [], prog.code()
    shapes = {n.name: tuple(n.meta["val"].shape) for n in prog.forward.graph.nodes if n.op == "placeholder"}
    assert shapes["fc1_weight"] == (2048, 1024) and shapes["fc2_weight"] == (1024, 2048)
    assert shapes["fc1_bias"] == (2048,) and shapes["fc2_bias"] == (1024,)


def test_data_parallel_reduces_gradients_in_buckets():
    model, inputs = _mlp(1024, 4096, 1024, 65536)
    rank = RankSpec.fake(("dp",), (8,), (5,))
    plan, cap, prog = program(model, inputs, mse, autopar.fake_mesh(8, "dp"), rank, device="h100",
                              pins={"*": (R,)}, input_placements={0: (Shard(0),), 1: (Shard(0),)})
    fwd, bwd = collectives(prog.forward, rank), collectives(prog.backward, rank)
    # Forward: only the loss is reduced (the mean over the batch shard is Partial(avg)).
    assert fwd == [("all_reduce", "dp")], prog.code()
    out = next(n for n in prog.forward.graph.nodes if n.op == "output")
    assert _feeds(out.args[0][0], prog.forward) == fwd
    # Backward: the four gradients all-reduced in buckets as DDP fills them, nothing else: the first bucket
    # holds at most 1 MiB (fc2's bias alone: fc2's weight is 16.8 MB), the next ones 25 MiB (fc2's weight with
    # fc1's bias, then fc1's weight).
    assert bwd == [("all_reduce", "dp")] * 3, prog.code()



class _Deep(nn.Module):
    def __init__(self, d: int, n: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(n))

    def forward(self, x, y):
        for layer in self.layers:
            x = F.silu(layer(x))
        return x


def test_gradients_reduced_alone_are_in_flight_one_at_a_time():
    """Weights sharded over both axes of a 2x2 mesh, the batch over both: each gradient is reduce-scattered over
    one axis, then the other, by itself (not in a bucket). Issued as soon as it exists, each holds its full-size
    input until waited on: the next such gradient is issued only once the previous one's collectives are done,
    so one is in flight at a time (as FSDP's reduce-scatters), not every gradient at full size."""
    with torch.device("meta"):
        model = _Deep(64, 4)
    inputs = (torch.zeros(8192, 64), torch.zeros(8192, 64))
    mesh = autopar.fake_mesh((2, 2), ("dp", "tp"), device_type="cpu")
    rank = RankSpec.fake(("dp", "tp"), (2, 2), (1, 0))
    plan, _, prog = program(model, inputs, mse, mesh, rank, pins={"*": (Shard(0), Shard(1))},
                            input_placements={0: (Shard(0), Shard(0)), 1: (Shard(0), Shard(0))})
    bwd = list(prog.backward.graph.nodes)
    chains: dict[str, list] = {}
    for n in bwd:
        if n.meta.get(ALONE_GRAD) is not None and collective_kind(n) is not None:
            chains.setdefault(n.meta[ALONE_GRAD], []).append(n)
    # (The first layer's may be reduced before its transpose, by the backward itself rather than after it.)
    assert len(chains) >= 3 and all([collective_kind(n) for n in c] == ["reduce_scatter"] * 2
                                    for c in chains.values()), prog.code()
    open_, most = set(), 0
    for n in bwd:
        if n.meta.get(ALONE_GRAD) is not None and collective_kind(n) is not None:
            open_.add(n)
            most = max(most, len(open_))
        elif n.op == "call_function" and n.args and n.args[0] in open_ and "wait" in str(n.target):
            open_.discard(n.args[0])
    assert most == 1, prog.code()
    # Each gradient's collectives are done (its last wait) before the next one's first is issued.
    order = {n: i for i, n in enumerate(bwd)}
    firsts = sorted(chains, key=lambda f: order[chains[f][0]])
    for f, nxt in zip(firsts, firsts[1:]):
        assert max(order[u] for u in chains[f][1].users) < order[chains[nxt][0]]
    # The memory the plan reports holds one such gradient beyond its shard: its full-size partial sum (64 x 64
    # fp32, 16 KiB) and a buffer as large (the contiguous copy the scatter over dim 1 reads), less the 4 KiB shard
    # the profile counts, and the next one's partial sum beyond its shard (it exists when this one is waited for);
    # not every gradient at full size to the end of the backward.
    assert plan.memory_breakdown["grad_buckets"] == 2 * 16384 - 4096 + (16384 - 4096)
    # The step's timeline runs them the same way: where the next gradient exists, the compute waits for the
    # previous one's first collective (over tp), its second (over dp) runs, and the next one's first starts
    # when it ends (rather than each gradient's collectives back to back from where it exists).
    steps = {(label, stream): (a, b) for stream, label, a, b in plan.timeline if label.startswith("grad ")}
    runs = sorted((steps[(f"grad {f}", "comm:tp")], steps[(f"grad {f}", "comm:dp")]) for f in chains)
    for (_, (_, dp_end)), ((tp_start, _), _) in zip(runs, runs[1:]):
        assert tp_start == pytest.approx(dp_end, rel=0, abs=1e-12)


def test_buckets_reduce_in_place_and_no_op_nodes_are_gone():
    """A multi-tensor gradient bucket of a data-parallel Llama is reduced in place; no-op nodes are gone; every
    rank issues its collectives in one order."""
    with torch.device("meta"):
        model = Llama(LLAMA_SMALL)
    tokens = torch.zeros(8, 16, dtype=torch.long)
    mesh = autopar.fake_mesh(4, "dp", device_type="cpu")
    plan, cap, _ = program(model, (tokens,), cross_entropy_loss, mesh, RankSpec.fake(("dp",), (4,), (0,)),
                           pins={"*": (R,)}, input_placements={0: (Shard(0),)})
    programs = [generate(plan, cap, RankSpec.fake(("dp",), (4,), (r,))) for r in range(4)]
    prog = programs[1]
    bwd = list(prog.backward.graph.nodes)
    reductions = [n for n in bwd if collective_kind(n) == "all_reduce"]
    assert len(reductions) >= 2 and any(n.target.overloadpacket.__name__ == "all_reduce_" for n in reductions)
    for n in reductions:
        if n.target.overloadpacket.__name__ == "all_reduce_":
            assert n.args[0].target is torch.ops.aten.cat.default  # a buffer of the program's own
    for gm in (prog.forward, prog.backward):
        assert not any(n.target is torch.ops.aten.detach.default for n in gm.graph.nodes)
        for n in gm.graph.nodes:
            if n.target is torch.ops.aten.t.default:
                assert n.args[0].target is not torch.ops.aten.t.default
    orders = {tuple(collectives(g, RankSpec.fake(("dp",), (4,), (0,)))) for p in programs
              for g in (p.forward, p.backward)}
    assert len(orders) == 2
    # The labels' gather (for the global token count) reads the input through slices and views only: it is
    # issued before any compute and waited on where the count is needed.
    fwd = list(prog.forward.graph.nodes)
    gather = next(n for n in fwd if collective_kind(n) == "all_gather")
    before = fwd[:fwd.index(gather)]
    assert {n.target for n in before if n.op == "call_function"} <= {torch.ops.aten.slice.Tensor,
                                                                   torch.ops.aten.clone.default,
                                                                   torch.ops.aten._unsafe_view.default}
    wait = next(iter(gather.users))
    assert fwd.index(wait) > fwd.index(next(n for n in fwd if n.target is torch.ops.aten.mm.default))


def _feeds(node, gm):
    """Collectives among the ancestors of `node`, in program order."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    rank = RankSpec.fake(("dp",), (8,))
    return collectives([n for n in gm.graph.nodes if n in seen], rank)


def test_fsdp_regathers_weights_in_backward_instead_of_saving_them():
    model, inputs = _mlp(1024, 4096, 1024, 65536)
    rank = RankSpec.fake(("dp",), (4,), (2,))
    _, _, prog = program(model, inputs, mse, autopar.fake_mesh(4, "dp"), rank, device="h100",
                         pins={"*": (Shard(0),)}, input_placements={0: (Shard(0),), 1: (Shard(0),)})
    gathers_fwd = [c for c in collectives(prog.forward, rank) if c[0] == "all_gather"]
    gathers_bwd = [c for c in collectives(prog.backward, rank) if c[0] == "all_gather"]
    assert gathers_fwd and gathers_bwd, prog.code()
    # Nothing gathered in the forward is kept for the backward: the forward saves only local shards.
    saved = {n.name for n in prog.backward.graph.nodes if n.op == "placeholder"}
    gathered = {n.name for n in prog.forward.graph.nodes if n.op == "call_function" and n.target.__name__ in
                ("wait_tensor", "all_gather_into_tensor")}
    assert not saved & gathered, saved & gathered
    assert prog.recomputed, "weights derived from parameters are recomputed in backward"
    grads = [c for c in collectives(prog.backward, rank) if c[0] == "reduce_scatter"]
    # Gradients leave as reduce-scattered shards in 25 MiB buckets, last layer first: fc2's weight (16 MiB)
    # with both biases, then fc1's weight.
    assert len(grads) == 2, prog.code()


@pytest.mark.slow
@pytest.mark.parametrize("layers,dp,batch,coords", [(8, 8, 8, (3, 5)), (4, 64, 64, (41, 6))],
                         ids=["8b-widths-64-ranks", "8b-widths-512-ranks"])
def test_llama3_8b_at_scale_local_shapes_and_groups(layers, dp, batch, coords):
    """Llama-3-8B's widths (8 of its 32 layers on 64 ranks; 4 layers on 512 ranks), planned on the full graph (no
    template), built on the meta device; one rank's program is generated, not run. Every layer is generated
    alike, so more layers add time and no check."""
    with torch.device("meta"):
        model = Llama(dataclasses.replace(LLAMA3_8B, n_layers=layers))
    tokens = torch.zeros(batch, 2048, dtype=torch.long)
    mesh = autopar.fake_mesh((dp, 8), ("dp", "tp"))
    rank = RankSpec.fake(("dp", "tp"), (dp, 8), coords)
    comp = compile_plan(model, mesh, (tokens,), loss_fn=cross_entropy_loss, config=Config(solver=QUIET),
                        template_layers=None)
    plan, cap = comp.plan, comp.captured
    prog = comp.program(rank)
    assert len(cap.params) == 2 + layers * 9 + 1
    shapes = {n.name: tuple(n.meta["val"].shape) for n in prog.forward.graph.nodes if n.op == "placeholder"}
    for fqn, node in cap.params.items():
        name = fqn.replace(".", "_")
        want = local_shape(tuple(node.meta["val"].shape), plan.param_layout(fqn), (dp, 8))
        assert shapes[name] == want, (fqn, shapes[name], want)
    assert shapes["input_0"] == local_shape((batch, 2048), plan.inputs[0], (dp, 8))
    # One axis each, and the flattened dp x tp group that the gradient buckets of replicated weights reduce over.
    sizes = {"autopar:dp": dp, "autopar:tp": 8, "autopar:dp+tp": dp * 8}
    n = 0
    for gm in (prog.forward, prog.backward):
        for node in gm.graph.nodes:
            name = collective_kind(node)
            if name is None:
                continue
            n += 1
            group = node.args[-1]
            assert group in sizes, (node.format_node(), group)
            if name in ("all_gather", "reduce_scatter"):
                assert node.args[-2] == sizes[group]
            if name == "all_to_all":
                assert len(node.args[1]) == sizes[group]
    assert n > 0
    # Every local value has the local shape of its planned layout (checked while generating); the loss is
    # replicated and every gradient leaves in its parameter's layout.
    out = next(n for n in prog.backward.graph.nodes if n.op == "output")
    for fqn, g in zip(prog.param_names, out.args[0]):
        want = local_shape(tuple(cap.params[fqn].meta["val"].shape), plan.param_layout(fqn), (dp, 8))
        assert tuple(g.meta["val"].shape) == want, fqn


@pytest.mark.slow
@pytest.mark.parametrize("shape,axes,coords", [((4,), ("dp",), (1,)), ((2, 2), ("dp", "tp"), (1, 0))],
                         ids=["dp4", "dp2xtp2"])
def test_template_plan_lowers_the_full_depth_graph(shape, axes, coords):
    """autopar.plan() captures 2 of llama-small's 4 layers; the plan (and its JSON copy) covers every node of
    the full-depth capture, and each layer's parameters get the layouts of the template's corresponding layer.
    The plan is pinned (FSDP on dp4, FSDP+TP on 2x2; the solver keeps this model replicated on CPU), so the
    layouts compared are sharded ones."""
    from autopar.compiler import capture_step, fingerprint
    from autopar.plan_check import check_plan
    from test_execution import _pins

    with torch.device("meta"):
        model = Llama(LLAMA_SMALL)
    tokens = torch.zeros(8, 64, dtype=torch.long)
    mesh = autopar.fake_mesh(shape, axes, device_type="cpu")
    pins = _pins("llama", axes, "fsdp_tp" if "tp" in axes else "fsdp")
    comp = compile_plan(model, mesh, (tokens,), loss_fn=cross_entropy_loss, config=Config(solver=QUIET, pins=pins))
    plan, template = comp.plan, comp.captured
    deepest = {f: lay for f, lay in plan.param_placements().items() if f.startswith("layers.3.")}
    assert deepest and all(isinstance(lay[0], Shard) for lay in deepest.values()), deepest  # past the template
    k = template.blocks[0].captured
    assert k < LLAMA_SMALL.n_layers
    full = capture_step(model, mesh, (tokens,), None, cross_entropy_loss, Config(solver=QUIET), template_layers=None)
    assert fingerprint(full) == plan.fingerprint  # same keys, ops and shapes as the template
    rank = RankSpec.fake(axes, shape, coords)
    want = _param_layouts(comp.program(rank))
    for p in (plan, Plan.from_json(plan.to_json())):
        check_plan(p, full)  # what parallelize(..., plan=p) checks before generating
        got = _param_layouts(full.program(rank, p))
        assert len(got) == len(full.captured.params)
        for fqn, lay in got.items():
            parts = fqn.split(".")
            if parts[0] == "layers":  # layer i of the model: the template's layer i, its last for deeper ones
                parts[1] = str(min(int(parts[1]), k - 1))
            assert lay == want[".".join(parts)], fqn


@pytest.mark.parametrize("kind,dim", [("all_gather", 0), ("all_gather", 1), ("all_reduce", None),
                                      ("reduce_scatter", 0), ("all_to_all", 0)])
def test_collectives_read_contiguous_values(kind, dim):
    """c10d's functional collectives take contiguous tensors (torch 2.11 raises otherwise): a transposed value
    (a weight's transpose in a Dynamo graph's linear) is copied before it is communicated."""
    from autopar.codegen.builder import Builder
    from autopar.redistribute import Step

    b = Builder()
    x = b.call(torch.ops.aten.transpose.int, (b.placeholder("w", (8, 4), torch.float32), 0, 1), phase="fwd")
    assert not x.meta["val"].is_contiguous()
    step = Step(kind, 0, dim=dim, dst_dim=1 if kind == "all_to_all" else None, op="sum")
    from autopar.codegen.collectives import emit_step

    emit_step(b, x, step, RankSpec.fake(("dp",), (2,), (0,)), "fwd")
    comm = [n for n in b.graph.nodes if collective_kind(n) is not None and n.args]
    assert comm and all(n.args[0].meta["val"].is_contiguous() for n in comm), [n.args[0].name for n in comm]


def _param_layouts(prog) -> dict[str, tuple]:
    """{parameter FQN: the layout of its local shard} in a generated program."""
    return {p.name: p.layout for p in prog.params}


def test_redistribution_steps_keep_shards_nested():
    S = Shard
    placements = [R, Partial(), Partial("avg"), S(0), S(1)]
    for n in (1, 2, 3):
        for src in itertools.product(placements, repeat=n):
            for dst in itertools.product([R, Partial(), S(0), S(1)], repeat=n):
                assert steps_valid(src, dst, plan_steps(src, dst)), (src, dst)
    # The simple cases keep their one-collective form.
    assert [s.kind for s in checked_steps((Partial(),), (S(0),))] == ["reduce_scatter"]
    assert [s.kind for s in checked_steps((S(0), R), (S(1), R))] == ["all_to_all"]
    # A dim sharded over both axes is gathered (a partial sum reduced and scattered over both) by one
    # collective over the flattened group; one reduce per op over several axes likewise.
    assert [(s.kind, s.axes) for s in checked_steps((S(0), S(0)), (R, R))] == [("all_gather", (0, 1))]
    assert [(s.kind, s.axes) for s in checked_steps((Partial(), Partial()), (S(1), S(1)))] == [
        ("reduce_scatter", (0, 1))]
    assert [(s.kind, s.axes) for s in checked_steps((Partial(), Partial()), (R, R))] == [("all_reduce", (0, 1))]
    assert [(s.kind, s.axes) for s in checked_steps((S(0), S(1)), (R, R))] == [("all_gather", (1,)),
                                                                               ("all_gather", (0,))]
    assert [(s.kind, s.axes) for s in checked_steps((S(0), R, S(0)), (R, R, R))] == [("all_gather", (0, 2))]


def test_unsupported_local_rewrite_is_refused_with_the_op_named():
    model = Llama(LLAMA_TINY)
    tokens = torch.zeros(4, 16, dtype=torch.long)
    mesh = autopar.fake_mesh(2, "tp")
    comp = compile_plan(model, mesh, (tokens,), loss_fn=cross_entropy_loss,
                        config=Config(solver=QUIET, template_layers=None, pins={"*": (R,)}, device="h100"))
    plan, cap = comp.plan, comp.captured
    # Shard the logits' sequence dim through `logits[:, :-1]`: a real slice of a sharded dim.
    data = Plan.from_json(plan.to_json())
    key = "output/fwd/slice"
    data.nodes[key].ins = [(Shard(1),)]
    data.nodes[key].outs = [(Shard(1),)]
    with pytest.raises(CodegenError, match=r"output/fwd/slice .*slice \[0:-1:1\] of sharded dim 1"):
        generate(data, cap, RankSpec.fake(("tp",), (2,)))


def test_generated_code_is_python_text():
    model, inputs = _mlp(64, 128, 64, 32)
    rank = RankSpec.fake(("dp", "tp"), (2, 2), (1, 0))
    _, _, prog = program(model, inputs, mse, autopar.fake_mesh((2, 2), ("dp", "tp")), rank, device="h100")
    text = prog.code()
    assert text.startswith("# forward\ndef forward(") and "\n# backward\ndef forward(" in text
    compile(prog.forward.code, "<forward>", "exec")
    compile(prog.backward.code, "<backward>", "exec")
    for kind, axis in collectives(prog.forward, rank) + collectives(prog.backward, rank):
        assert axis in ("dp", "tp") and kind in ("all_gather", "all_reduce", "reduce_scatter", "all_to_all")


def test_input_collectives_move_up_without_passing_collectives_or_breaking_order():
    """A collective reading an input through views moves up to the last collective before it; chain nodes
    already above that point stay, so their other users keep reading defined values."""
    import torch.fx as fx

    from autopar import _torch_compat as compat
    from autopar.codegen.schedule import issue_input_collectives_early

    c10d, aten = compat.c10d_functional_ops(), torch.ops.aten
    g = fx.Graph()
    x, w = g.placeholder("input_0"), g.placeholder("w")
    v = g.call_function(aten.view.default, (x, [-1]))
    u = g.call_function(aten.mul.Tensor, (v, v))
    c1 = g.call_function(c10d.all_reduce.default, (u, "sum", "g"))  # reads compute: stays
    w1 = g.call_function(c10d.wait_tensor.default, (c1,))
    m = g.call_function(aten.mm.default, (w, w))
    c2 = g.call_function(c10d.all_gather_into_tensor.default, (v, 2, "g"))
    w2 = g.call_function(c10d.wait_tensor.default, (c2,))
    g.output((w1, m, w2))
    assert issue_input_collectives_early(g, {"input_0"}) == 1
    g.lint()
    order = list(g.nodes)
    assert order.index(c1) < order.index(c2) < order.index(w1) < order.index(m)
    assert order.index(v) < order.index(u)


def test_fsdp_backward_issues_the_next_layers_gather_while_this_layer_computes():
    """In the backward, waiting on a layer's bucket of re-gathered weights issues the next bucket the backward
    needs (as FSDP's backward prefetch): one bucket ahead, so no matmul runs between waiting on one bucket and
    issuing the next, and the next is not issued before the previous is waited on."""
    from autopar.codegen.collectives import BUCKET_META

    with torch.device("meta"):
        model = Llama(LLAMA_TINY)
    config = Config(solver=SolverConfig(show_progress=False), device="h100", pins={"*": (Shard(0),)},
                    input_placements={0: (Shard(0),)})
    comp = compile_plan(model, autopar.fake_mesh(4, "dp"), (torch.zeros(8, 16, dtype=torch.long),),
                        loss_fn=cross_entropy_loss, config=config)
    nodes = list(comp.program(RankSpec.fake(("dp",), (4,), (1,))).backward.graph.nodes)
    issues = [i for i, n in enumerate(nodes) if n.meta.get(BUCKET_META) is not None and "all_gather" in str(n.target)]
    waits = [next(i for i, u in enumerate(nodes) if u.op == "call_function" and u.args and u.args[0] is nodes[k]
                  and "wait" in str(u.target)) for k in issues]
    mms = [i for i, n in enumerate(nodes) if n.target is torch.ops.aten.mm.default]
    assert len(issues) == 2 * LLAMA_TINY.n_layers, [nodes[k].meta[BUCKET_META] for k in issues]
    for k in range(1, len(issues)):
        assert waits[k - 1] < issues[k], "issued before the bucket before it is waited on"
        assert not [m for m in mms if waits[k - 1] < m < issues[k]], "a matmul runs before the next is issued"
    assert [m for m in mms if m > issues[-1]], "the last bucket is issued while layers still compute"
