"""A synthetic language for training demos and numerics checks."""
from __future__ import annotations

import torch


def synthetic_corpus(vocab: int, batch: int, seq: int, steps: int, seed: int = 0) -> list[torch.Tensor]:
    """`steps` batches of counting sequences (start and stride random per row, modulo the vocabulary): a
    language a small model learns in a few dozen steps, so the loss visibly falls."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        start = torch.randint(0, vocab, (batch, 1), generator=gen)
        stride = torch.randint(1, 8, (batch, 1), generator=gen)
        out.append((start + stride * torch.arange(seq)) % vocab)
    return out
