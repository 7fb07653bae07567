"""Run 4-rank gloo training jobs again and again and count how they end: the hunt for rare worker aborts.

Usage (from the repo root): python benchmarks/stress_gloo.py [--runs 20] [--cases cnn,t5,llama] [--timeout 300]

Each run is a fresh `torchrun --nproc-per-node 4` job (new processes, new gloo rendezvous) of this file in worker
mode, which builds the case's model, parallelizes it on a (2, 2) mesh, trains 3 steps and checks the loss against
one device on rank 0. The summary counts clean exits, failures by exit code and signal (SIGABRT is -6 from a
worker, reported by torchrun as exit code 1 with "Signal 6"), and prints the tail of each failing run's output.
Not part of `make test`.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import signal as signal_module
import subprocess
import sys
import time

CASES = ("cnn", "t5", "llama")


def worker(case: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import autopar

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from test_finetuning import build as build_finetune  # noqa: E402  (the fine-tuning suite's models)

    name = {"cnn": "cnn", "t5": "t5", "llama": "llama"}[case]
    model, inputs, _ = build_finetune(name)
    ref_model, _, _ = build_finetune(name)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    pm = autopar.parallelize(model, mesh, inputs, config=autopar.Config(solver=autopar.SolverConfig(show_progress=False)))
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, eps=1e-6)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-3, eps=1e-6)
    for _ in range(3):
        loss = pm(*inputs)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref = ref_model(*inputs)
        ref.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        if abs(loss.item() - ref.item()) > 1e-4 * max(1.0, abs(ref.item())):
            raise SystemExit(f"loss {loss.item()} differs from one device's {ref.item()}")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a.worker)
        return
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    outcomes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    failures = []
    for i in range(a.runs):
        for case in a.cases.split(","):
            t0 = time.perf_counter()
            cmd = [torchrun, "--standalone", "--nproc-per-node", "4", __file__, "--worker", case]
            # A session of its own, so a run past the timeout is killed with all its workers.
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                    start_new_session=True)
            try:
                text, _ = proc.communicate(timeout=a.timeout)
                code = proc.returncode
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal_module.SIGKILL)
                text, _ = proc.communicate()
                code = "timeout"
            signal = re.search(r"Signal (\d+)", text)
            what = "ok" if code == 0 else f"exit {code}" + (f" (signal {signal.group(1)})" if signal else "")
            outcomes[case][what] += 1
            print(f"run {i + 1:3d} {case:6s} {what:24s} {time.perf_counter() - t0:6.1f} s", flush=True)
            if code != 0:
                failures.append((i, case, what, "\n".join(text.splitlines()[-30:])))
    print("\nsummary")
    for case, counts in outcomes.items():
        print(f"  {case:6s} " + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())))
    for i, case, what, tail in failures:
        print(f"\n--- run {i + 1} {case}: {what}\n{tail}")


if __name__ == "__main__":
    main()
