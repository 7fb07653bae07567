"""How a plan's model was named (a built-in model, or `file.py:function` with its inputs), so a plan file can
rebuild its model: `autopar compare plan.json` and `autopar program plan.json` need nothing else.

A plan made in Python from a live model records only the model's class (`ModelSpec.python`); whatever needs
the model then asks for it by name (`plan.compare(model, example_inputs)`).
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import os
import sys
from typing import Any, Callable

from autopar.errors import AutoparError

GPT2_SIZES = {"gpt2": (768, 12, 12), "gpt2-medium": (1024, 24, 16), "gpt2-large": (1280, 36, 20),
              "gpt2-xl": (1600, 48, 25)}


class ModelSpecError(AutoparError):
    """A model or inputs reference that cannot be loaded; the message says what to change."""


@dataclasses.dataclass
class BuiltModel:
    """A model ready to plan: the module (on the meta device for built-in models), its example inputs and
    keyword inputs, and the loss function (None: the model returns its loss)."""

    model: Any
    inputs: tuple
    loss_fn: Callable | None
    kwargs: dict | None = None


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """`source` is "builtin" (name: a built-in model), "file" (name: path/to/model.py:function, `inputs`:
    path/to/model.py:example_inputs) or "python" (name: the class of a live model; cannot be rebuilt)."""

    source: str
    name: str
    batch: int | None = None
    seq: int | None = None
    inputs: str | None = None
    loss: str | None = None

    @classmethod
    def named(cls, name: str, *, batch: int = 8, seq: int | None = None, inputs: str | None = None,
              loss: str | None = None) -> "ModelSpec":
        """A built-in name or a `path/to/model.py:function` reference (file paths are made absolute, so the
        plan file works from any directory)."""
        if name in known_models():
            return cls("builtin", name, batch, seq, None, _absolute(loss))
        if ":" not in name:
            raise ModelSpecError(f"unknown model {name!r}; built-in models: {', '.join(known_models())}; "
                                 "or give your own as path/to/model.py:build_model")
        for ref, what in ((name, "model"), (inputs, "--inputs"), (loss, "--loss")):
            path = (ref or "").rpartition(":")[0]
            if path.endswith(".py") and not os.path.isfile(path):
                raise ModelSpecError(f"{what} file {path!r} does not exist")
        return cls("file", _absolute(name), batch, seq, _absolute(inputs), _absolute(loss))

    @classmethod
    def python(cls, model: Any) -> "ModelSpec":
        t = type(model)
        return cls("python", f"{t.__module__}.{t.__qualname__}")

    @property
    def rebuildable(self) -> bool:
        return self.source in ("builtin", "file")

    def describe(self) -> str:
        if self.source == "python":
            return f"a live {self.name} given in Python"
        extra = ", ".join(f"{k} {v}" for k, v in (("batch", self.batch), ("seq", self.seq)) if v is not None)
        return f"{self.name}" + (f" ({extra})" if extra else "")

    def build(self) -> BuiltModel:
        if not self.rebuildable:
            raise ModelSpecError(f"this plan was made in Python from {self.describe()}; it cannot be rebuilt from "
                                 "the plan file: pass the model in Python (plan.compare(model, example_inputs), "
                                 "autopar.program(plan, rank, model=..., example_inputs=...)), or plan from the "
                                 "command line with path/to/model.py:build_model")
        loss = load_object(self.loss, "--loss") if self.loss else None
        if self.source == "builtin":
            return _builtin(self.name, self.batch or 8, self.seq, loss)
        import torch

        model = _call(load_object(self.name, "model"), batch=self.batch, seq=self.seq)
        if not isinstance(model, torch.nn.Module):
            raise ModelSpecError(f"{self.name} returned {type(model).__name__}, not a torch.nn.Module")
        ref = self.inputs or f"{self.name.rpartition(':')[0]}:example_inputs"
        try:
            fn = load_object(ref, "--inputs")
        except ModelSpecError as e:
            if self.inputs:
                raise
            raise ModelSpecError(f"{e}; give --inputs path/to/model.py:example_inputs (a function returning a tuple "
                                 "of inputs)") from None
        inputs = _call(fn, batch=self.batch, seq=self.seq)
        inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        return BuiltModel(model, inputs, loss)

    def to_json(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @classmethod
    def from_json(cls, d: dict) -> "ModelSpec":
        return cls(**{f.name: d.get(f.name) for f in dataclasses.fields(cls)})


def known_models() -> list[str]:
    from autopar.models.llama import CONFIGS

    return list(CONFIGS) + list(GPT2_SIZES)


def _absolute(ref: str | None) -> str | None:
    """`path/to/file.py:name` with an absolute path; module references stay as they are."""
    if ref is None:
        return None
    path, sep, attr = ref.rpartition(":")
    if sep and path.endswith(".py"):
        return f"{os.path.abspath(path)}:{attr}"
    return ref


def load_object(ref: str, what: str) -> Any:
    """`path/to/file.py:name` or `package.module:name` -> the named object."""
    path, sep, attr = ref.rpartition(":")
    if not sep or not path or not attr:
        raise ModelSpecError(f"{what} {ref!r} must look like path/to/file.py:function")
    if path.endswith(".py"):
        if not os.path.isfile(path):
            raise ModelSpecError(f"{what} file {path!r} does not exist")
        spec = importlib.util.spec_from_file_location(f"_autopar_user_{abs(hash(path))}", path)
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
        try:
            spec.loader.exec_module(module)
        finally:
            sys.path.pop(0)
    else:
        try:
            module = importlib.import_module(path)
        except ImportError as e:
            raise ModelSpecError(f"cannot import {path!r} for {what}: {e}") from None
    if not hasattr(module, attr):
        raise ModelSpecError(f"{path} has no {attr!r} (for {what})")
    return getattr(module, attr)


def _call(fn: Callable, **available: Any) -> Any:
    """Call fn with the keyword arguments it declares among `available` (batch, seq)."""
    params = inspect.signature(fn).parameters
    return fn(**{k: v for k, v in available.items() if k in params and v is not None})


def _builtin(name: str, batch: int, seq: int | None, loss: Callable | None) -> BuiltModel:
    import torch

    from autopar.models.llama import CONFIGS, Llama, cross_entropy_loss

    if name in GPT2_SIZES:
        return _gpt2(name, batch, seq, loss)
    cfg = CONFIGS[name]
    seq = seq or cfg.max_seq_len
    if seq > cfg.max_seq_len:
        raise ModelSpecError(f"--seq {seq} exceeds {name}'s max_seq_len {cfg.max_seq_len}")
    with torch.device("meta"):
        model = Llama(cfg)
    return BuiltModel(model, (torch.zeros(batch, seq, dtype=torch.long),), loss or cross_entropy_loss)


def _gpt2(name: str, batch: int, seq: int | None, loss: Callable | None) -> BuiltModel:
    import torch
    import torch.nn.functional as F

    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        raise ModelSpecError(f"{name} needs the transformers package (pip install 'autopar[hf]')") from None
    dim, layers, heads = GPT2_SIZES[name]
    seq = seq or 1024
    cfg = GPT2Config(n_embd=dim, n_layer=layers, n_head=heads, n_positions=max(1024, seq), use_cache=False)
    # Eager attention with an explicit mask: the SDPA path and the packed-sequence check branch on tensor values,
    # which a fake-tensor trace cannot follow.
    cfg._attn_implementation = "eager"
    with torch.device("meta"):
        model = GPT2LMHeadModel(cfg)

    def lm_loss(out, tokens, *rest, **kwargs):
        logits = out.logits if hasattr(out, "logits") else out[0]
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))

    mask = {"attention_mask": torch.ones(batch, seq, dtype=torch.long)}
    return BuiltModel(model, (torch.zeros(batch, seq, dtype=torch.long),), loss or lm_loss, mask)
