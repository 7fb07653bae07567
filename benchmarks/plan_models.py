"""Planning time of transformers models (random init, tiny configs) on a fake 8x8 H100 mesh, and whether any
op lacked a sharding rule.

Usage: python benchmarks/plan_models.py
"""
from __future__ import annotations

import time
import warnings

import torch

import autopar
from autopar.testing.hf_models import IMAGE_MODELS, MODELS


def main() -> None:
    print(f"{'model':8} {'plan s':>7} {'missing-rule warnings':>22}  techniques")
    for name in sorted(MODELS):
        torch.manual_seed(0)
        model, args, kwargs = MODELS[name](batch=8, **({} if name in IMAGE_MODELS else {"seq": 64}))
        mesh = autopar.fake_mesh((8, 8), ("dp", "tp"))
        cfg = autopar.Config(device="h100", links={"dp": "ib", "tp": "nvlink"},
                             solver=autopar.SolverConfig(show_progress=False))
        t0 = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            plan = autopar.plan(model, mesh, args, example_kwargs=kwargs, config=cfg)
        missing = sum("sharding rule" in str(w.message) for w in caught)
        print(f"{name:8} {time.perf_counter() - t0:7.1f} {missing:>22}  {','.join(sorted(plan.techniques)) or '-'}")


if __name__ == "__main__":
    main()
