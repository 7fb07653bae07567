"""The FP8 variants of a matmul under one layout strategy: which are eligible on its local shapes, and what each
costs (autopar/cost/fp8.py). enumerate_strategies adds them, estimate_costs prices them, build_plan records them.

Eligibility is checked on the LOCAL sharded shapes against CUDA's _scaled_mm rules (every dim a multiple of 16,
formats, bf16 output for rowwise), on every device, so a plan means the same on CPU and GPU. A device without FP8
offers variants only under Fp8Config(mode="all"), priced at the matmul's own rate.
"""
from __future__ import annotations

import torch

from autopar.cost.fp8 import cast_time, fp8_copy_time, fp8_gemm_time, has_fp8
from autopar.cost import collective_time, link_spec
from autopar.fp8.formats import dims_ok, formats_ok
from autopar.fp8.sites import GemmSite
from autopar.layout import local_shape
from autopar.strategy import FP8_ROWWISE, FP8_TENSORWISE, FP8_TENSORWISE_AG, NodeStrategy

SCALINGS = {FP8_TENSORWISE: "tensorwise", FP8_ROWWISE: "rowwise", FP8_TENSORWISE_AG: "tensorwise"}


def local_dims(site: GemmSite, strategy: NodeStrategy, shapes: list[tuple], sizes) -> tuple[int, int, int]:
    """(m, k, n) of the GEMM one rank runs under `strategy` (`shapes`: the node's global tensor input shapes)."""
    m, k = local_shape(shapes[site.a], strategy.ins[site.a], sizes)
    _, n = local_shape(shapes[site.b], strategy.ins[site.b], sizes)
    return m, k, n


def eligible(site: GemmSite, strategy: NodeStrategy, shapes: list[tuple], sizes, fp8cfg) -> list[str]:
    """The FP8 variants this layout strategy may run as."""
    m, k, n = local_dims(site, strategy, shapes, sizes)
    if not dims_ok(m, k, n):
        return []
    out = []
    if "tensorwise" in fp8cfg.scaling and formats_ok(site.a_fmt, site.b_fmt, False, site.out_dtype):
        out.append(FP8_TENSORWISE)
        if fp8cfg.fp8_all_gather and site.weight is not None:
            out.append(FP8_TENSORWISE_AG)
    # Rowwise keeps an E5M2 gradient in the first operand (the only place the CUTLASS kernel takes it):
    # C = A @ B runs as C^T = B^T @ A^T when B is the gradient.
    a_fmt, b_fmt = (site.b_fmt, site.a_fmt) if site.b_fmt != site.a_fmt and site.b_fmt == "e5m2" else (
        site.a_fmt, site.b_fmt)
    if "rowwise" in fp8cfg.scaling and formats_ok(a_fmt, b_fmt, True, site.out_dtype):
        out.append(FP8_ROWWISE)
    return out


def variant_time(site: GemmSite, variant: str, strategy: NodeStrategy, shapes: list[tuple], dtypes: list,
                 sizes, hw) -> float:
    """Seconds of one run of the matmul as `variant` on one rank: the FP8 GEMM and its operand casts (the
    weight's cast of the all-gather variant is priced on the weight's edge, see weight_edge_time)."""
    m, k, n = local_dims(site, strategy, shapes, sizes)
    scaling = SCALINGS[variant]
    t = fp8_gemm_time(m, k, n, site.out_dtype.itemsize, hw, dtypes[site.a], rowwise=scaling == "rowwise")
    if variant != FP8_TENSORWISE_AG or site.weight != site.a:
        t += cast_time(m, k, dtypes[site.a].itemsize, scaling, site.a_t, hw)
    if variant != FP8_TENSORWISE_AG or site.weight != site.b:
        t += cast_time(n, k, dtypes[site.b].itemsize, scaling, site.b_t, hw)
    return t


def weight_edge_time(site: GemmSite, shape: tuple, dtype: torch.dtype, src: tuple, dst: tuple, mesh, hw,
                     plain_transition: float) -> float:
    """The weight operand's edge under the all-gather variant: where the layout change is all-gathers only (FSDP),
    the shard is cast to FP8 (tensorwise, its amax max-reduced over the gathering axes so every rank gets one
    scale) and gathered in FP8, half the bytes of bf16; the backward's grad_input GEMM also transposes the gathered
    copy. Elsewhere the operand is cast where it is used, after `plain_transition` (the edge's own price)."""
    from autopar.redistribute import plan_steps

    steps = plan_steps(tuple(src), tuple(dst))
    transposed = site.b_t if site.weight == site.b else site.a_t
    rows, cols = (shape[1], shape[0]) if site.weight == site.b else shape  # the cast writes B^T's or A's rows
    if not steps or any(st.kind != "all_gather" for st in steps):
        lrows, lcols = _local_rows_cols(shape, dst, mesh.shape, site.weight == site.b)
        return plain_transition + cast_time(lrows, lcols, dtype.itemsize, "tensorwise", transposed, hw)
    srows, scols = _local_rows_cols(shape, src, mesh.shape, site.weight == site.b)
    t = cast_time(srows, scols, dtype.itemsize, "tensorwise", False, hw)
    numel = srows * scols
    for st in steps:
        ways = st.ranks(mesh.shape)
        link = min((link_spec(hw, mesh.links[a]) for a in st.axes), key=lambda lk: lk.bandwidth)
        t += collective_time("all_reduce", 4, ways, link)
        t += collective_time("all_gather", numel * ways, ways, link)
        numel *= ways
    if transposed:
        t += fp8_copy_time(numel, hw)
    return t


def _local_rows_cols(shape: tuple, layout: tuple, sizes, is_b: bool) -> tuple[int, int]:
    r, c = local_shape(shape, layout, sizes)
    return (c, r) if is_b else (r, c)


def device_offers_fp8(hw, fp8cfg) -> bool:
    """Whether variants are enumerated at all: "auto" on FP8 hardware, "all" anywhere."""
    return fp8cfg.mode == "all" or (fp8cfg.mode == "auto" and has_fp8(hw))


__all__ = ["eligible", "variant_time", "weight_edge_time", "local_dims", "device_offers_fp8", "SCALINGS"]
