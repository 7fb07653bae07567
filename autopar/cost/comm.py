"""Alpha-beta time of one collective over n ranks on one link kind, with the ring algorithm's traffic factors.

With B the per-direction link bandwidth, a the per-step latency and N the byte count defined per kind:

    all_reduce      2 (n-1)/n * N / B  +  2 (n-1) a    N = size of the tensor being reduced (input = output)
    all_gather        (n-1)/n * N / B  +    (n-1) a    N = size of the gathered OUTPUT (n times each shard)
    reduce_scatter    (n-1)/n * N / B  +    (n-1) a    N = size of the INPUT before scattering
    all_to_all        (n-1)/n * N / B  +    (n-1) a    N = size of one rank's local input

A ring all-reduce is a reduce-scatter followed by an all-gather, hence twice the steps and twice the traffic;
each rank sends all but its own 1/n share of N. These are the "bus bandwidth" factors of the NCCL tests,
https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md, where measured bus bandwidth approaches
the link bandwidth for large messages, so B here is the per-GPU per-direction link figure.
"""
from __future__ import annotations

from autopar.cost.hardware import LinkSpec

# kind -> (multiple of (n-1)/n * N / B, multiple of (n-1) latency steps)
_RING_FACTORS = {
    "all_reduce": (2.0, 2.0),
    "all_gather": (1.0, 1.0),
    "reduce_scatter": (1.0, 1.0),
    "all_to_all": (1.0, 1.0),
}
COLLECTIVES = tuple(_RING_FACTORS)


def collective_time(kind: str, nbytes: float, n: int, link: LinkSpec) -> float:
    """Seconds for collective `kind` over `n` ranks moving `nbytes` (as defined per kind above) on `link`."""
    factors = _RING_FACTORS.get(kind)
    if factors is None:
        raise ValueError(f"unknown collective {kind!r}; known: {', '.join(COLLECTIVES)}")
    if n < 1:
        raise ValueError(f"a collective needs at least one rank, got n={n}")
    if n == 1:
        return 0.0  # a single rank already holds the result
    traffic, steps = factors
    return traffic * (n - 1) / n * nbytes / link.bandwidth + steps * (n - 1) * link.latency


__all__ = ["COLLECTIVES", "collective_time"]
