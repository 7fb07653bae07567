"""Peak compute, memory bandwidth, memory size and link figures of the devices the planner can target.

Sources for the figures below (dense, i.e. without 2:4 sparsity, which the datasheets quote at double):
  * A100 80GB SXM: NVIDIA A100 Tensor Core GPU datasheet (nvidia.com/content/dam/en-zz/Solutions/Data-Center/
    a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf): BF16/FP16 tensor 312 TFLOPS, FP32 19.5 TFLOPS,
    HBM2e 2,039 GB/s, 80 GB, NVLink 3 600 GB/s (bidirectional, i.e. 300 GB/s each way).
  * H100 SXM: NVIDIA H100 Tensor Core GPU datasheet (resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-
    datasheet): BF16/FP16 1,979 TFLOPS and FP8 3,958 TFLOPS *with sparsity*, so 989 and 1,979 dense; FP32 67 TFLOPS;
    HBM3 3.35 TB/s; 80 GB; NVLink 4 900 GB/s bidirectional per GPU (450 GB/s each way).
  * H200 SXM: NVIDIA H200 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h200/): same Hopper compute as
    H100 SXM, HBM3e 4.8 TB/s, 141 GB, NVLink 4 900 GB/s.
  * InfiniBand: one NVIDIA ConnectX-7 NDR adapter per GPU, 400 Gb/s = 50 GB/s each way (ConnectX-7 product brief).
  * PCIe: Gen4 x16 is 32 GB/s each way raw (PCI-SIG); Gen5 doubles that, but 32 GB/s is the figure a collective
    sees in practice on either once protocol overhead and host bridges are counted, so one number serves both.
  * Latencies are per ring step, the order of magnitude NCCL reaches: ~5 us over NVLink, ~10 us over IB and PCIe.
  * "cpu" is one single-threaded rank of a small host running several gloo ranks over TCP loopback; its figures
    are round orders of magnitude from `benchmarks/runtime_cpu.py`-style runs (4 ranks on 2 cores: ~2.5e10 fp32
    flop/s for a 512x512 matmul on an idle core, half of that per rank when ranks share cores; ~0.4-0.7 ms for
    a 4-byte all-reduce; a 16 MB all-reduce in ~60 ms, 0.4 GB/s in the formula of comm.py), meant to make CPU
    runs plan sensibly, not to predict a particular machine.
Memory sizes are the decimal marketing figures (80e9, 141e9 bytes): a little below the physical capacity, which
leaves room for the CUDA context and allocator fragmentation the planner does not model.
"""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class LinkSpec:
    bandwidth: float  # bytes/s per direction per GPU
    latency: float  # seconds per collective step


@dataclasses.dataclass(frozen=True)
class HardwareSpec:
    name: str
    peak_flops: dict[torch.dtype, float]  # dense FLOP/s
    hbm_bandwidth: float  # bytes/s
    memory_bytes: float
    links: dict[str, LinkSpec]  # by link kind: "nvlink", "ib", "pcie", "loopback"

    def __hash__(self) -> int:
        # The dict fields are unhashable; hashing the scalars keeps specs usable as cache keys.
        return hash((self.name, self.hbm_bandwidth, self.memory_bytes))


_IB = LinkSpec(bandwidth=50e9, latency=5e-6)  # ConnectX-7 400 Gb/s per GPU; ~5 us per hop
_PCIE = LinkSpec(bandwidth=32e9, latency=5e-6)  # Gen4 x16 each way
_LOOPBACK = LinkSpec(bandwidth=5e8, latency=5e-4)  # gloo over TCP loopback


def _gpu_links(nvlink_bandwidth: float) -> dict:
    return {"nvlink": LinkSpec(bandwidth=nvlink_bandwidth, latency=1e-6), "ib": _IB, "pcie": _PCIE}


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_HOPPER_FLOPS = {torch.bfloat16: 989e12, torch.float16: 989e12, torch.float32: 67e12,
                 **{d: 1979e12 for d in _FP8}}

HARDWARE: dict[str, HardwareSpec] = {
    "a100": HardwareSpec("a100", {torch.bfloat16: 312e12, torch.float16: 312e12, torch.float32: 19.5e12},
                         hbm_bandwidth=2.039e12, memory_bytes=80 * 2**30, links=_gpu_links(300e9)),
    "h100": HardwareSpec("h100", dict(_HOPPER_FLOPS), hbm_bandwidth=3.35e12, memory_bytes=80 * 2**30,
                         links=_gpu_links(450e9)),
    "h200": HardwareSpec("h200", dict(_HOPPER_FLOPS), hbm_bandwidth=4.8e12, memory_bytes=141e9,
                         links=_gpu_links(450e9)),
    "cpu": HardwareSpec("cpu", {torch.float32: 1e10, torch.bfloat16: 1e10}, hbm_bandwidth=1e10,
                        memory_bytes=64e9, links={"loopback": _LOOPBACK}),
}


def get_hardware(name: str) -> HardwareSpec:
    """The spec of a device by name, case-insensitively."""
    spec = HARDWARE.get(name.lower())
    if spec is None:
        raise ValueError(f"unknown device {name!r}; known devices: {', '.join(sorted(HARDWARE))}")
    return spec


def link_spec(hw: HardwareSpec, kind: str) -> LinkSpec:
    """The figures of one link kind on a device; a clear error for a kind the device lacks."""
    link = hw.links.get(kind)
    if link is None:
        raise ValueError(f"device {hw.name!r} has no {kind!r} link; it has: {', '.join(sorted(hw.links))}")
    return link


def _is_fp8(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and dtype.itemsize == 1 and "float8" in str(dtype)


def peak_flops_for(hw: HardwareSpec, dtype: torch.dtype) -> float:
    """Dense peak FLOP/s of `hw` for math in `dtype`, falling back to the nearest listed figure.

    float16 and bfloat16 run on the same tensor cores at the same rate, so either stands in for the other. Any FP8
    format uses the device's FP8 figure, and devices without FP8 tensor cores raise. FP64 runs at half the FP32 rate
    on A100/H100 (and on CPU SIMD units); integer and boolean work is priced at the FP32 rate.
    """
    table = hw.peak_flops
    if dtype in table:
        return table[dtype]
    if dtype in (torch.float16, torch.bfloat16):
        other = torch.bfloat16 if dtype == torch.float16 else torch.float16
        if other in table:
            return table[other]
    if _is_fp8(dtype):
        fp8 = [v for d, v in table.items() if _is_fp8(d)]
        if not fp8:
            raise ValueError(f"device {hw.name!r} has no FP8 support, so it cannot run {dtype} math")
        return max(fp8)
    if dtype in (torch.float64, torch.complex128):
        return table[torch.float32] / 2
    if dtype == torch.complex64 or not dtype.is_floating_point:
        return table[torch.float32]
    raise ValueError(f"device {hw.name!r} has no compute figure for {dtype}")


__all__ = ["LinkSpec", "HardwareSpec", "HARDWARE", "get_hardware", "link_spec", "peak_flops_for"]
