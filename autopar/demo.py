"""`make demo`: plan Llama-3-8B on a simulated 8x8 H100 cluster, then train the built-in `llama-wide` on four CPU
processes (a 2x2 gloo mesh) beside a single-device reference: the planner splits its matmuls over the tp axis,
and the demo prints what each rank holds, which collectives its program runs, and both losses step by step."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch


def plan_8b() -> None:
    import autopar
    from autopar.models.llama import LLAMA3_8B, Llama, cross_entropy_loss

    print("== Planning Llama-3-8B on a simulated 8x8 H100 cluster (tp on NVLink, dp on InfiniBand) ==")
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = Llama(LLAMA3_8B)
    mesh = autopar.fake_mesh((8, 8), ("dp", "tp"))
    cfg = autopar.Config(device="h100", links={"dp": "ib", "tp": "nvlink"}, memory_limit_gb=80)
    plan = autopar.plan(model, mesh, (torch.zeros(16, 8192, dtype=torch.long),), loss_fn=cross_entropy_loss,
                        config=cfg)
    print(plan.summary())
    print(f"planned in {time.perf_counter() - t0:.1f} s (the weights were never allocated)\n")


def train_small() -> int:
    script = Path(__file__).resolve().parents[1] / "examples" / "train_llama.py"
    if not script.exists():
        print(f"training example not found at {script}; run the demo from a source checkout")
        return 1
    print("== Training llama-wide (19M parameters) on 4 CPU processes (2x2 dp x tp mesh, gloo) ==")
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [torchrun, "--standalone", "--nproc-per-node", "4", str(script), "--steps", "20"]
    return subprocess.call(cmd, env=env)


def main() -> None:
    plan_8b()
    sys.exit(train_small())


if __name__ == "__main__":
    main()
