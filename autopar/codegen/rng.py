"""Random numbers in the generated program: dropout masks drawn from explicitly seeded generators.

A rank's own default generator would give every rank a different mask, also the ranks that hold REPLICAS of
one activation (the tensor-parallel ranks of a dp x tp plan, where activations replicate over tp): their
copies would diverge and the gradients would be wrong. Codegen therefore lowers every training-mode
`aten.native_dropout` (p > 0) to `autopar::seeded_dropout`, which draws its mask from a fresh
`torch.Generator` seeded by

    mix(step_seed, key, shard)
    step_seed = mix(base_seed, step)      the program's `rng_seed` input, one per call of the program
    key       = hash of the node's stable name (`layers.3.attn.resid_dropout/fwd/native_dropout`)
    shard     = this rank's coordinates on the mesh axes where the dropout's input is SHARDED (0 on the
                axes where it is Replicate or Partial), as one mixed-radix number

so ranks holding the same shard draw the same mask bit for bit (replicas agree, and the parts of a Partial
input are masked alike, which keeps their sum the masked value), while different shards, different dropout
nodes and different steps draw independent masks. The mask is an output of the op and is saved for backward
(partition never recomputes a random op), so backward always uses the mask forward drew.

The base seed is agreed once by all ranks (`parallelize`), and the step counts the program's calls
(`ParallelModule`). Masks depend on the base seed, the step, the node, the mesh and the plan's layout of the
dropout input; they are reproducible run to run, but not equal to a single-device run's masks.
"""
from __future__ import annotations

import hashlib
from typing import Sequence

import torch
from torch.distributed.tensor import Placement, Shard

_M64 = (1 << 64) - 1
SEED_INPUT = "rng_seed"  # the name of the program input that carries the step seed


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def mix(*values: int) -> int:
    """A 63-bit seed from integers (order matters): nearby inputs give unrelated seeds."""
    h = 0
    for v in values:
        h = _splitmix64(h ^ (int(v) & _M64))
    return h >> 1


def step_seed(base_seed: int, step: int) -> int:
    """The program's `rng_seed` input for its `step`-th call (counting from 0)."""
    return mix(base_seed, step)


def stream_key(name: str) -> int:
    """A stable 63-bit key of a node name (Python's hash() of a str changes from process to process)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") >> 1


def shard_index(layout: Sequence[Placement | None], coords: Sequence[int], sizes: Sequence[int]) -> int:
    """This rank's shard of a tensor laid out as `layout`: its coordinates on the axes that shard the tensor
    as one mixed-radix number, the coordinate on every Replicate or Partial axis counted as 0. Equal on the
    ranks holding the same piece, different on ranks holding different pieces."""
    idx = 0
    for p, c, n in zip(layout, coords, sizes):
        idx = idx * n + (c if isinstance(p, Shard) else 0)
    return idx


def is_random_dropout(args: Sequence, kwargs: dict) -> bool:
    """Whether a native_dropout call draws a mask: training mode (train is True or None) and p > 0."""
    p = args[1] if len(args) > 1 else kwargs.get("p")
    train = args[2] if len(args) > 2 else kwargs.get("train")
    return train is not False and float(p) > 0


def dropout_scale(p: float) -> float:
    """What native_dropout multiplies kept values by."""
    return 0.0 if p >= 1 else 1.0 / (1.0 - p)


@torch.library.custom_op("autopar::seeded_dropout", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def seeded_dropout(x: torch.Tensor, p: float, seed: int, key: int, shard: int) -> tuple[torch.Tensor, torch.Tensor]:
    """native_dropout(x, p, train=True) with the mask drawn from a generator seeded by mix(seed, key, shard):
    returns (x * mask * scale, mask), mask bool, as native_dropout does. The uniform draws are float32 in
    x's shape, so a mask does not depend on x's dtype."""
    gen = torch.Generator(device=x.device)
    gen.manual_seed(mix(seed, key, shard))
    mask = torch.rand(x.shape, generator=gen, device=x.device, dtype=torch.float32) >= p
    return x * mask * dropout_scale(p), mask


def _fake_dropout(x, p, seed, key, shard):
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty(x.shape, dtype=torch.bool,
                                                                                  device=x.device)


seeded_dropout.register_fake(_fake_dropout)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(output[1])
    ctx.scale = dropout_scale(inputs[1])


def _backward(ctx, grad_out, grad_mask):
    (mask,) = ctx.saved_tensors
    return torch.ops.aten.native_dropout_backward.default(grad_out, mask, ctx.scale), None, None, None, None


seeded_dropout.register_autograd(_backward, setup_context=_setup_context)

@torch.library.custom_op("autopar::seeded_dropout_t", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def seeded_dropout_t(x: torch.Tensor, p: float, seed: torch.Tensor, key: int, shard: int) -> tuple[torch.Tensor,
                                                                                                   torch.Tensor]:
    """seeded_dropout with the step seed in a 0-d int64 tensor: the form a compiled program takes, whose
    compiler would otherwise specialize on the seed's value and recompile every step."""
    return seeded_dropout(x, p, int(seed), key, shard)


seeded_dropout_t.register_fake(_fake_dropout)


SEEDED_DROPOUT = torch.ops.autopar.seeded_dropout.default
SEEDED_DROPOUT_T = torch.ops.autopar.seeded_dropout_t.default

__all__ = ["SEED_INPUT", "SEEDED_DROPOUT", "SEEDED_DROPOUT_T", "mix", "step_seed", "stream_key", "shard_index", "is_random_dropout",
           "dropout_scale", "seeded_dropout"]
