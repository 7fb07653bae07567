"""Shared test setup: quiet solver progress, deterministic torch, single-threaded CPU math, and hypothesis
profiles: "ci" (the default: derandomized, the same examples every run, so `make test` is reproducible) and
"explore" (new examples each run: `pytest --hypothesis-profile=explore`)."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from hypothesis import settings  # noqa: E402

torch.manual_seed(0)
torch.set_num_threads(1)

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
