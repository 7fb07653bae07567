"""Pipelined training steps on torch.distributed.pipelining: each stage Program this rank runs inside a
PipelineStage, the plan's schedule class (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B,
ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble) ordering the microbatches and sending activations and
gradients between stages over the pipeline axis's process group.

A stage runs its Program's forward graph for a microbatch as an autograd.Function (the received activations in,
the sent ones or the loss out) and its backward graph when the schedule runs the microbatch's backward: whole,
or for zero-bubble schedules split into the input gradients (sent back at once) and the weight gradients (run
later; codegen/split_backward.py). Weight gradients accumulate locally over the microbatches; after the schedule,
the step's loss weights (the loss's count, see autopar/runtime/accumulate.py) are summed over the pipeline axis,
and each stage's grad_sync graph reduces its gradients once into the parameters' `.grad`.

The model's inputs a stage reads (token ids on the first stage, labels on the last) are split into the same
microbatches and handed to each stage directly, in order: every schedule runs a stage's forwards in microbatch
order. The schedule's loss function returns the last stage's output, the microbatch loss the Program computes.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, schedules

from autopar import _torch_compat as compat
from autopar.program import Program


class _Runner:
    """One stage's Program over one step's microbatches."""

    def __init__(self, program: Program, device: torch.device):
        self.program = program
        self.device, self.device_type = device, device.type
        self.last = not program.activations_out
        self.n_heads = len(program.activations_out) or 1
        n = len(program.params)
        self.updated = [n + program.buffer_names.index(f) for f in program.buffer_updates]

    def start(self, params: list, buffers: list, inputs: list[list], seeds: list[list]) -> None:
        self.params, self.buffers, self.inputs, self.seeds = params, buffers, inputs, seeds
        self.k = 0
        self.acc: dict[int, torch.Tensor] = {}
        self.weights: dict[int, torch.Tensor] = {}
        self.loss_sum: torch.Tensor | None = None
        self.weight_sum: torch.Tensor | None = None

    def forward(self, acts: tuple) -> tuple[tuple, tuple, int]:
        k, self.k = self.k, self.k + 1
        prog = self.program
        with torch.autocast(self.device_type, enabled=False), torch.no_grad():
            out = prog.forward(*self.params, *self.buffers, *self.inputs[k], *[a.detach() for a in acts],
                               *self.seeds[k])
            u = len(self.updated)
            for i, new in zip(self.updated, out[self.n_heads:self.n_heads + u]):
                self.buffers[i - len(self.params)].copy_(new)
        rest = out[self.n_heads + u + len(prog.outputs):]
        count = rest[0] if prog.returns_count else None
        saved = rest[1:] if prog.returns_count else rest
        heads = tuple(out[:self.n_heads])
        if self.last:
            loss = heads[0]
            w = count.to(loss.dtype).reshape(loss.shape) if count is not None else torch.ones_like(loss)
            self.weights[k] = w
            part = torch.where(w != 0, loss * w, torch.zeros_like(loss))  # no counted token: 0 / 0 adds nothing
            self.loss_sum = part if self.loss_sum is None else self.loss_sum + part
            self.weight_sum = w if self.weight_sum is None else self.weight_sum + w
        return heads, tuple(saved), k

    def _tangents(self, k: int, grads: tuple) -> list | None:
        """The backward graph's tangents: the gradients of the sent activations, or the loss's weight; None
        for a last-stage microbatch without a counted token (an empty sum: nothing to differentiate)."""
        if not self.last:
            return [g.contiguous() for g in grads]
        w = self.weights[k]
        if self.program.returns_count and not bool(w != 0):
            return None
        g = grads[0] if grads and grads[0] is not None else torch.ones_like(w)
        return [(g * w).contiguous()]

    def _zeros(self) -> tuple:
        return tuple(torch.zeros(a.local_shape, dtype=a.dtype, device=self.device) for a in self.program.activations_in)

    def _accumulate(self, grads) -> None:
        for i, g in enumerate(grads):
            if g is not None:
                self.acc[i] = g if i not in self.acc else self.acc[i] + g

    def backward(self, k: int, saved: tuple, grads: tuple) -> tuple:
        tangents = self._tangents(k, grads)
        if tangents is None:
            return self._zeros()
        with torch.autocast(self.device_type, enabled=False), torch.no_grad():
            out = self.program.backward(*saved, *tangents)
        n = len(self.program.params)
        self._accumulate(out[:n])
        return tuple(out[n:])

    def backward_input(self, k: int, saved: tuple, grads: tuple) -> tuple[tuple, Any]:
        tangents = self._tangents(k, grads)
        if tangents is None:
            return self._zeros(), None
        with torch.autocast(self.device_type, enabled=False), torch.no_grad():
            out = self.program.backward_input(*saved, *tangents)
        n = len(self.program.activations_in)
        return tuple(out[:n]), (saved, tangents, tuple(out[n:]))

    def backward_weight(self, handle) -> None:
        if handle is None:
            return
        saved, tangents, carried = handle
        with torch.autocast(self.device_type, enabled=False), torch.no_grad():
            self._accumulate(self.program.backward_weight(*saved, *tangents, *carried))

    def finish(self, scale, params: list) -> None:
        """The accumulated gradients times `scale`, reduced once (grad_sync) and added into `.grad`."""
        prog = self.program
        index = {f: i for i, f in enumerate(prog.param_names)}
        phs = [n for n in prog.grad_sync.graph.nodes if n.op == "placeholder"]
        acc = []
        for f, ph in zip(prog.synced, phs):
            g = self.acc.get(index[f])
            acc.append(g * scale if g is not None else torch.zeros(tuple(ph.meta["val"].shape),
                                                                    dtype=ph.meta["val"].dtype, device=self.device))
        with torch.autocast(self.device_type, enabled=False), torch.no_grad():
            synced = prog.grad_sync(*acc)
            for f, g in zip(prog.synced, synced):
                p = params[index[f]]
                grad = compat.dtensor_like(g, p)
                if p.grad is None:
                    p.grad = grad
                else:
                    p.grad += grad
        self.acc = {}


class _StageFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, runner: _Runner, dummy: torch.Tensor, *acts: torch.Tensor):
        heads, saved, k = runner.forward(acts)
        ctx.runner, ctx.saved, ctx.k = runner, saved, k
        return heads if len(heads) > 1 else heads[0]

    @staticmethod
    def backward(ctx, *grads):
        ins = ctx.runner.backward(ctx.k, ctx.saved, grads)
        ctx.saved = None
        return (None, None, *ins)


class _StageModule(nn.Module):
    """What a PipelineStage calls: the stage Program's forward on the received activations."""

    def __init__(self, runner: _Runner):
        super().__init__()
        self.runner = runner
        self._dummy = torch.zeros((), device=runner.device, requires_grad=True)  # so the first stage's output
        # has a backward

    def forward(self, *acts: torch.Tensor):
        return _StageFn.apply(self.runner, self._dummy, *acts)


class _Stage(PipelineStage):
    """A PipelineStage whose split backward (zero-bubble schedules) runs the Program's backward_input and
    backward_weight graphs; a whole backward goes through autograd into _StageFn."""

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        if backward_type == "input":
            out = bwd_kwargs["stage_output"]
            node = (out[0] if isinstance(out, (tuple, list)) else out).grad_fn
            grads = bwd_kwargs["output_grads"] or ()
            ins, handle = node.runner.backward_input(node.k, node.saved, tuple(grads))
            node.saved = None
            return ins, (node.runner, handle)
        if backward_type == "weight":
            runner, handle = bwd_kwargs["param_groups"]
            runner.backward_weight(handle)
            return (), None
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)


def _loss(output, target):
    return output


class PipelineRunner:
    """Runs a pipelined plan's steps for a ParallelModule: this rank's stage Programs, their PipelineStages and
    the schedule, built once."""

    def __init__(self, programs: list[Program], mesh, device: torch.device):
        plan = programs[0].plan
        pp = plan.pipeline
        self.programs, self.microbatches, self.pipeline = programs, plan.microbatches, pp
        self.group = mesh.get_group(pp.axis)
        self.device = device
        self.runners = [_Runner(p, device) for p in programs]
        stages = []
        for prog, runner in zip(programs, self.runners):
            # Example tensors of what a stage receives and sends (static metadata); requiring grad, so the
            # received activations do and their gradients are sent back.
            ins = tuple(torch.zeros(a.local_shape, dtype=a.dtype, device=device, requires_grad=True)
                        for a in prog.activations_in)
            outs = tuple(torch.zeros(a.local_shape, dtype=a.dtype, device=device, requires_grad=True)
                         for a in prog.activations_out) or (torch.zeros((), device=device, requires_grad=True),)
            stages.append(_Stage(_StageModule(runner), prog.stage, pp.stages, device, input_args=ins,
                                 output_args=outs, group=self.group))
        cls = getattr(schedules, pp.schedule)
        single = issubclass(cls, schedules.PipelineScheduleSingle)
        self.schedule = cls(stages[0] if single else stages, self.microbatches, loss_fn=_loss, scale_grads=False)

    def step(self, pm: Any, args: tuple, kwargs: dict) -> torch.Tensor:
        from autopar.runtime.accumulate import _microbatches

        m = self.microbatches
        batches = _microbatches(pm, self.programs[0], args, kwargs)
        seeds = pm._step_seeds(next((p for p in self.programs if p.takes_seed), self.programs[0]), m)
        for prog, runner in zip(self.programs, self.runners):
            params = [compat.dtensor_local(pm.get_parameter(f)) for f in prog.param_names]
            buffers = [_local(pm.get_buffer(f)) for f in prog.buffer_names]
            inputs = [pm._local_inputs(a, kw, prog) for a, kw in batches]
            runner.start(params, buffers, inputs, [seeds[k] if prog.takes_seed else [] for k in range(m)])
        self.schedule.step(target=torch.zeros(m), return_outputs=False)
        # The step's loss and weight live on the last stage's ranks: sum them over the pipeline axis.
        last = next((r for r in self.runners if r.last), None)
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        if last is not None and last.loss_sum is not None:
            total[0], total[1] = last.loss_sum.double(), last.weight_sum.double()
        dist.all_reduce(total, group=self.group)
        reduction = self.programs[0].loss_reduction
        scale = {"count": 1.0 / total[1].item() if total[1] else float("nan"), "sum": 1.0,
                 "mean": 1.0 / m}[reduction]
        for prog, runner in zip(self.programs, self.runners):
            runner.finish(scale, [pm.get_parameter(f) for f in prog.param_names])
        return (total[0] * scale).to(torch.float32)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


__all__ = ["PipelineRunner"]
