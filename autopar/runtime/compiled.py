"""Running a Program as the compiled form of a torch.compile graph (autopar.backend): the graph's flat inputs in
(DTensor parameters and buffers, the call's tensors), the graph's outputs out: the loss, or, from a graph before
a graph break, the values the code after the break goes on with, whose gradients come back into its backward."""
from __future__ import annotations

import time
from typing import Any

import torch
from torch import fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from autopar import _torch_compat as compat
from autopar.program import Program


class CompiledStep:
    """The compiled form of one graph: takes the graph's flat inputs (the DTensor parameters and buffers, the
    call's tensors), runs the rank's Program (forward now, backward when the loss is differentiated) and
    returns the graph's outputs: the replicated loss and the others as DTensors (or full tensors).

    Per Program parameter (and buffer), `param_pos` is its position among the graph's inputs (None: the graph
    does not read it; `params` holds it); `crossing` the positions of values an earlier graph computed, passed
    as replicated stand-in parameters; `input_pos` the position of each Program input; `loss` the loss's
    position among the graph's outputs. A graph before a graph break has no loss: `heads` are the positions of
    the values it hands on (the Program's activations_out, replicated), returned as full tensors whose
    gradients run the Program's backward."""

    def __init__(self, program: Program, param_pos: list, params: list, crossing: set, buffer_pos: list,
                 buffers: list, input_pos: list, loss: int, mesh: DeviceMesh, inner: str, outputs: str, seed: int,
                 inner_s: list, heads: list[int] | None = None):
        from autopar.runtime.module import _Runner
        from autopar.runtime.state import mesh_coords, mesh_device

        self.program, self.mesh, self.outputs = program, mesh, outputs
        self._device = mesh_device(mesh)
        program.forward.to(self._device)  # constants the program holds
        program.backward.to(self._device)
        if inner == "inductor":
            from autopar.codegen import functional

            # Each graph compiled by Inductor on its first call; not through torch.compile, as Dynamo is
            # disabled while a backend's compiled function runs.
            self._runner = _Runner(functional(program), mesh.device_type)
            self._runner._graphs = tuple(g if g is None else _InductorGraph(g, inner_s) for g in self._runner._graphs)
        else:
            self._runner = _Runner(program, mesh.device_type)
        self._coords, self._sizes = mesh_coords(mesh), tuple(mesh.mesh.shape)
        self._replicate = tuple(Replicate() for _ in mesh.mesh.shape)
        self._param_pos, self._params, self._crossing = param_pos, params, crossing
        self._buffer_pos, self._buffers, self._input_pos = buffer_pos, buffers, input_pos
        self._loss, self._heads = loss, list(heads or [])
        self._seed, self._step = seed, 0

    def __call__(self, *flat: Any) -> list:
        from autopar.runtime.module import _TrainStep

        compat.implicit_replication_in_dynamo()  # again: torch._dynamo.reset() clears it
        params = [p if i is None else self._crossed(flat[i]) if i in self._crossing else flat[i]
                  for i, p in zip(self._param_pos, self._params)]
        buffers = [_local(b if i is None else flat[i]) for i, b in zip(self._buffer_pos, self._buffers)]
        inputs = [self._local_input(flat[i], spec) for i, spec in zip(self._input_pos, self.program.inputs)]
        seed = self._next_seed()
        if self._heads:
            outs = _HandOn.apply(self._runner, len(params), *params, *buffers, *inputs, *seed)
            return self._handed_on(outs[:len(self._heads)], outs[len(self._heads):])
        if torch.is_grad_enabled():
            loss, *outs = _TrainStep.apply(self._runner, len(params), *params, *buffers, *inputs, *seed)
        else:
            loss, outs, _, _ = self._runner.forward(*[compat.dtensor_local(p) for p in params], *buffers, *inputs,
                                                    *seed)
        return self._results(loss, outs)

    def _crossed(self, x: torch.Tensor) -> DTensor:
        """A value an earlier graph computed, as the replicated DTensor its stand-in parameter is: the gradient
        the program returns for it flows back into that graph."""
        if isinstance(x, DTensor):
            return x.redistribute(self.mesh, self._replicate)
        return DTensor.from_local(x, self.mesh, self._replicate, run_check=False)

    def _results(self, loss: torch.Tensor, outs) -> list:
        from autopar.runtime.state import as_dtensor

        others = [as_dtensor(o, self.mesh, tuple(spec.layout), spec.shape) for o, spec in zip(outs, self.program.outputs)]
        if self.outputs == "global":
            others = [o.full_tensor() for o in others]
        others.insert(self._loss, loss)
        return others

    def _handed_on(self, heads, others) -> list:
        """The outputs of a graph before a break in the graph's order: the handed-on values where `heads` says,
        the others (replicated, full) in the remaining places."""
        out: list = [None] * (len(heads) + len(others))
        for k, h in zip(self._heads, heads):
            out[k] = h
        rest = iter(others)
        return [next(rest) if o is None else o for o in out]

    def _next_seed(self) -> list:
        from autopar.codegen.rng import step_seed

        if not self.program.takes_seed:
            return []
        self._step += 1
        seed = step_seed(self._seed, self._step - 1)
        return [torch.tensor(seed, dtype=torch.int64) if self._runner.seed_as_tensor else seed]

    def _local_input(self, x: torch.Tensor, spec) -> torch.Tensor:
        from autopar.runtime.state import local_shard

        layout = tuple(spec.layout)
        if isinstance(x, DTensor):
            if tuple(x.placements) == layout:
                return x.to_local()
            x = x.full_tensor()
        return local_shard(x, layout, self._coords, self._sizes).to(self._device).contiguous()


class _InductorGraph:
    """A graph compiled by Inductor for the arguments of its first call (the Program's shapes are static)."""

    def __init__(self, gm: fx.GraphModule, seconds: list):
        self.gm, self.fn, self.seconds = gm, None, seconds

    def __call__(self, *args: Any):
        if self.fn is None:
            t0 = time.perf_counter()
            self.fn = compat.inductor_compile(self.gm, list(args))
            self.seconds[0] += time.perf_counter() - t0
        return self.fn(*args)


class _HandOn(torch.autograd.Function):
    """A graph before a graph break as one autograd node. Forward: the Program's forward over (parameter shards,
    buffers, input shards) -> the values it hands on (replicated, so full tensors) and its other outputs.
    Backward: the gradients of those values, as the later graphs computed them, are the tangents of the
    Program's backward -> the parameters' gradient shards."""

    @staticmethod
    def forward(ctx, runner, n_params: int, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        params = flat[:n_params]
        heads, outputs, _, saved = runner.forward(*[compat.dtensor_local(p) for p in params], *flat[n_params:])
        ctx.runner, ctx.params, ctx.n_rest = runner, params, len(flat) - n_params
        ctx.save_for_backward(*saved)
        ctx.mark_non_differentiable(*outputs)
        return (*heads, *outputs)

    @staticmethod
    def backward(ctx, *grads):
        specs = ctx.runner.program.activations_out
        device = next((g.device for g in grads if g is not None), None)
        tangents = [torch.zeros(s.local_shape, dtype=s.dtype, device=device) if g is None else g.contiguous()
                    for g, s in zip(grads, specs)]
        out = ctx.runner.backward(*ctx.saved_tensors, *tangents)
        if ctx.runner.nonfinite is not None:
            out = ctx.runner.nonfinite.check(out)
        params = [None if g is None else compat.dtensor_like(g, p) for g, p in zip(out, ctx.params)]
        return (None, None, *params, *([None] * ctx.n_rest))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


__all__ = ["CompiledStep"]
