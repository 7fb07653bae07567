"""Shared test setup: quiet solver progress, deterministic torch, single-threaded CPU math."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.manual_seed(0)
torch.set_num_threads(1)
