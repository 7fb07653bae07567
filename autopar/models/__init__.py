"""Built-in models for demos, tests and benchmarks."""
from autopar.models.llama import (CONFIGS, LLAMA3_8B, LLAMA3_70B, LLAMA3_405B, LLAMA_SMALL, LLAMA_TINY, LLAMA_WIDE, Llama,
                                  LlamaConfig, cross_entropy_loss)

__all__ = ["CONFIGS", "LLAMA3_8B", "LLAMA3_70B", "LLAMA3_405B", "LLAMA_SMALL", "LLAMA_TINY", "LLAMA_WIDE", "Llama",
           "LlamaConfig", "cross_entropy_loss"]
