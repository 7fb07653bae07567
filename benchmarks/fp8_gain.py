"""What FP8 gains by the cost model: Llama-3 8B and 70B on an 8x8 H100 mesh with FP8 off and "auto", and the
predicted speedup of one linear layer (forward + both backward GEMMs) on a grid of M, K, N beside torchao's
published H100 measurements.

Usage: python benchmarks/fp8_gain.py [--models 8b,70b] [--skip-models] [--skip-grid]

Predictions, not measurements: no GPU ran here. torchao's end-to-end runs use torch.compile, activation
checkpointing and batch 1 per GPU; the plans here price the step without recomputation
(Config(recompute="off")), so the gain is FP8's alone. A linear's FP8 time is the three GEMMs at the FP8 peak (rowwise:
90% of it) plus each operand's amax/scale/cast kernels (kernel floor 3 us), as autopar/cost/fp8.py prices them;
its bf16 time is the three GEMMs at the bf16 peak. Both are rooflines at datasheet peaks.
"""
from __future__ import annotations

import argparse
import time

import torch

# torchao.float8 README (H100, torch.compile, fwd+bwd of one linear, tensorwise): "M, K, N = 1024, 2048, 1024 ...
# benchmark speedup is 0.80"; "M, K, N = 4096, 8192, 16384 ... benchmark speedup is 1.39".
TORCHAO = {(1024, 2048, 1024): 0.80, (4096, 8192, 16384): 1.39}
# torchao.float8 README, "Training benchmarks": Llama3-8b, 8 H100, batch 1 x 8192 per GPU, FSDP2, torch.compile,
# per-op SAC: 6150 tokens/s bf16; tensorwise with float8 all-gather +25.03%; rowwise with bf16 all-gather +10.05%.
TORCHAO_8B = {"tensorwise": 0.2503, "rowwise": 0.1005}
GRID = (1024, 2048, 4096, 8192, 16384)


def linear_times(m: int, k: int, n: int, hw) -> dict[str, float]:
    """Seconds of one linear y = x @ w.T (x: m x k, w: n x k, bf16) forward and backward, per variant."""
    from autopar.fp8.sites import GemmSite
    from autopar.fp8.variants import variant_time
    from autopar.strategy import FP8_ROWWISE, FP8_TENSORWISE, NodeStrategy

    bf16 = torch.bfloat16

    def site(a_fmt, a_t, b_t):
        return GemmSite(a=0, b=1, a_fmt=a_fmt, b_fmt="e4m3", a_t=a_t, b_t=b_t, weight=None, weight_fqn=None,
                        out_dtype=bf16, module="linear", phase="")

    gemms = [(site("e4m3", False, False), (m, k), (k, n)),  # forward: x @ w.T
             (site("e5m2", False, True), (m, n), (n, k)),  # grad_input: gy @ w
             (site("e5m2", True, True), (n, m), (m, k))]  # grad_weight: gy.T @ x
    out = {"bf16": 0.0, "fp8 tensorwise": 0.0, "fp8 rowwise": 0.0}
    s = NodeStrategy(((), ()), ((),))
    for st, a, b in gemms:
        mm, kk, nn = a[0], a[1], b[1]
        flops, nbytes = 2.0 * mm * kk * nn, 2.0 * (mm * kk + kk * nn + mm * nn)
        out["bf16"] += max(flops / hw.peak_flops[bf16], nbytes / hw.hbm_bandwidth)
        for variant, label in ((FP8_TENSORWISE, "fp8 tensorwise"), (FP8_ROWWISE, "fp8 rowwise")):
            out[label] += variant_time(st, variant, s, [a, b], [bf16, bf16], (), hw)
    return out


def grid(hw) -> None:
    print("\nPredicted speedup of one linear, forward + backward, H100 (bf16 time / FP8 time; best of tensorwise and "
          "rowwise, tensorwise in brackets)")
    print("M \\ K=N  " + "".join(f"{d:>16}" for d in GRID))
    for m in GRID:
        cells = []
        for d in GRID:
            t = linear_times(m, d, d, hw)
            best = t["bf16"] / min(t["fp8 tensorwise"], t["fp8 rowwise"])
            cells.append(f"{best:9.2f} [{t['bf16'] / t['fp8 tensorwise']:4.2f}]")
        print(f"{m:<9}" + "".join(f"{c:>16}" for c in cells))
    print("\nBeside torchao's published H100 figures (tensorwise, measured):")
    print(f"{'M, K, N':>20} {'torchao':>8} {'tensorwise':>11} {'rowwise':>8}")
    for (m, k, n), measured in TORCHAO.items():
        t = linear_times(m, k, n, hw)
        print(f"{f'{m}, {k}, {n}':>20} {measured:8.2f} {t['bf16'] / t['fp8 tensorwise']:11.2f} "
              f"{t['bf16'] / t['fp8 rowwise']:8.2f}")


def models(names: list[str]) -> None:
    import autopar
    from autopar.models.llama import CONFIGS, Llama, cross_entropy_loss
    from autopar.strategy import VARIANT_TEXT

    batch = {"8b": 16, "70b": 8}
    print("Llama-3 on an 8x8 H100 mesh (dp over InfiniBand, tp over NVLink), 8192-token sequences, "
          "estimated step time")
    print(f"{'model':10} {'batch':>5} {'fp8 off':>10} {'fp8 auto':>10} {'gain':>7} {'FP8 GEMMs':>12}  variants "
          "(matmul kinds)   plan s")
    for name in names:
        with torch.device("meta"):
            model = Llama(CONFIGS[f"llama3-{name}"])
        mesh = autopar.fake_mesh((8, 8), ("dp", "tp"))
        steps, t0, plans = {}, time.perf_counter(), {}
        for fp8 in ("off", "auto"):
            cfg = autopar.Config(device="h100", links={"dp": "ib", "tp": "nvlink"}, memory_limit_gb=80, fp8=fp8,
                                 recompute="off", solver=autopar.SolverConfig(show_progress=False))
            plans[fp8] = autopar.plan(model, mesh, (torch.zeros(batch[name], 8192, dtype=torch.long),),
                                      loss_fn=cross_entropy_loss, config=cfg)
            steps[fp8] = plans[fp8].estimated_step_time
        f = plans["auto"].fp8
        kinds: dict[str, int] = {}
        for n in plans["auto"].nodes.values():
            if n.variant:
                kinds[VARIANT_TEXT[n.variant]] = kinds.get(VARIANT_TEXT[n.variant], 0) + 1
        share = f"{f['fp8_gemms']:g}/{f['eligible_gemms']:g}"
        print(f"{'llama3-' + name:10} {batch[name]:>5} {steps['off']:9.3f}s {steps['auto']:9.3f}s "
              f"{(steps['off'] / steps['auto'] - 1) * 100:6.1f}% {share:>12}  "
              f"{', '.join(f'{v} x{c}' for v, c in sorted(kinds.items()))}   {time.perf_counter() - t0:.0f}")
        print(f"{'':10} with FP8 off the plan says: {plans['off'].fp8.get('auto_would_save_s', 0) * 1e3:.1f} ms "
              "of compute per step for 'auto' on the same layouts")


def single_node() -> None:
    """Llama-3-8B on one 8-GPU node over data only, as torchao measured it end to end (torchao: 8192-token
    sequences with activation recomputation; without recomputation 8 x 8192 tokens need 80.04 GiB per rank here,
    so this plans 8 x 4096 at 80 GB)."""
    import autopar
    from autopar.config import Fp8Config
    from autopar.models.llama import LLAMA3_8B, Llama, cross_entropy_loss

    with torch.device("meta"):
        model = Llama(LLAMA3_8B)
    mesh = autopar.fake_mesh((8,), ("dp",))
    steps = {}
    for label, fp8 in (("off", "off"), ("tensorwise", Fp8Config(mode="auto", scaling=("tensorwise",))),
                       ("rowwise", Fp8Config(mode="auto", scaling=("rowwise",), fp8_all_gather=False)),
                       ("auto", "auto")):
        cfg = autopar.Config(device="h100", links={"dp": "nvlink"}, memory_limit_gb=80, fp8=fp8,
                             recompute="off", solver=autopar.SolverConfig(show_progress=False))
        steps[label] = autopar.plan(model, mesh, (torch.zeros(8, 4096, dtype=torch.long),),
                                    loss_fn=cross_entropy_loss, config=cfg).estimated_step_time
    print("\nLlama-3-8B on 8 H100 (one node, dp=8 over NVLink), 8 x 4096 tokens: estimated gain over fp8 off "
          f"({steps['off']:.3f} s), beside torchao's measured end-to-end gain")
    print(f"{'scaling offered':34} {'step':>8} {'gain':>7} {'torchao':>8}")
    for label, text in (("tensorwise", "tensorwise (+ FP8 all-gather)"), ("rowwise", "rowwise (bf16 all-gather)"),
                        ("auto", "both (auto)")):
        measured = f"{TORCHAO_8B[label] * 100:+.1f}%" if label in TORCHAO_8B else "-"
        print(f"{text:34} {steps[label]:7.3f}s {(steps['off'] / steps[label] - 1) * 100:+6.1f}% {measured:>8}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="8b,70b")
    ap.add_argument("--skip-models", action="store_true")
    ap.add_argument("--skip-grid", action="store_true")
    a = ap.parse_args()
    from autopar.cost import get_hardware

    if not a.skip_models:
        models(a.models.split(","))
        single_node()
    if not a.skip_grid:
        grid(get_hardware("h100"))


if __name__ == "__main__":
    main()
