"""Where a target forward's time goes: the harness of ``constrained-spec bench profile``
(figures in docs/performance.md).

A verify pass of k new tokens after a prompt of ``context`` tokens is timed plainly (the
figure to trust), then once more with forward hooks that time each part of the model:

- output projection: the ``lm_head`` over all k rows;
- linears: every projection inside the decoder layers (int4 kernels at native precision);
- attention: the attention modules less their projections (scores, softmax, the float64
  invariant path, the KV cache update);
- norms: the RMSNorms (a float64 mean of squares when batch-invariant);
- other: the rest (embedding, rotary, residual adds, the MLP's activation, Python and
  dispatch).
Hooks cost a few microseconds each, so each part's share is taken from the hooked run and
applied to the plain time. The native model's decode and verify passes take a flat path that no
module hook sees (``models.native_decode``, ``models.gguf_decode``): its plain time is measured as decoding pays it, and
the hooked run goes through transformers' forward, whose shares are then those of the same ops.

Beside them: the part of the time spent in dtype conversions and copies (torch's profiler,
``aten::_to_copy`` and ``aten::copy_``; they happen inside the parts above), and the bytes a
forward must read (weights at their stored precision plus the KV cache it attends over), the
floor that memory bandwidth puts under it.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import torch
from torch import nn

from ..models.invariant import cache_dtype

#: The parts a forward's time is split into, in the order they are reported.
PARTS = ("output projection", "linears", "attention", "norms", "other")
DEFAULT_KS = (1, 4, 12, 21)


@dataclass
class ForwardProfile:
    """One (precision, k) row: milliseconds per forward by part, and the bytes it reads."""

    precision: str
    k: int
    context: int
    total_ms: float
    parts_ms: dict[str, float] = field(default_factory=dict)
    conversions_ms: float = 0.0
    weight_mb: float = 0.0
    kv_mb: float = 0.0

    @property
    def ms_per_token(self) -> float:
        """Plain milliseconds per new token of the pass."""
        return self.total_ms / self.k

    def as_dict(self) -> dict[str, Any]:
        """The row as plain values (for ``--json``)."""
        return asdict(self) | {"ms_per_token": round(self.ms_per_token, 2)}


def _is_linear(module: nn.Module) -> bool:
    name = type(module).__name__
    return isinstance(module, nn.Linear) or name in ("Int4Linear", "Int4Part", "BucketedLinear", "QuantLinear",
                                                     "SharedInputPart")


class _PartTimer:
    """Forward hooks that add each part's wall time; a linear inside another linear (a fused
    int4 kernel called by its part, a bucketed layer's wrapped one) counts once."""

    def __init__(self, model: nn.Module) -> None:
        self.ms = dict.fromkeys(PARTS[:-1], 0.0)
        self._handles: list[Any] = []
        self._stack: list[tuple[str, float]] = []
        self._linear_depth = 0
        self._linear_in_attention = 0.0
        output = model.get_output_embeddings()
        for module in model.modules():
            if module is output:
                self._hook(module, "output projection")
            elif _is_linear(module):
                self._hook(module, "linears")
            elif type(module).__name__.endswith("RMSNorm"):
                self._hook(module, "norms")
            elif type(module).__name__.endswith("Attention"):
                self._hook(module, "attention")

    def _hook(self, module: nn.Module, part: str) -> None:
        def enter(*_: Any) -> None:
            if part == "linears":
                self._linear_depth += 1
                if self._linear_depth > 1:
                    return
            self._stack.append((part, time.perf_counter()))

        def leave(*_: Any) -> None:
            if part == "linears":
                self._linear_depth -= 1
                if self._linear_depth > 0:
                    return
            name, t0 = self._stack.pop()
            spent = (time.perf_counter() - t0) * 1000
            if name == "attention":  # its own projections were counted as linears
                spent -= self._linear_in_attention
                self._linear_in_attention = 0.0
            elif name == "linears" and any(p == "attention" for p, _ in self._stack):
                self._linear_in_attention += spent
            self.ms[name] += spent

        self._handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def _weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer the forward reads (a tied embedding counted once)."""
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def _kv_bytes(model: nn.Module, positions: int) -> int:
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    # A batch-invariant model's cache may hold float64 copies or bfloat16 (``models.invariant.cache_dtype``).
    stored = cache_dtype(model) if getattr(model, "batch_invariant", False) else None
    dtype = stored or next(model.parameters()).dtype
    return c.num_hidden_layers * 2 * c.num_key_value_heads * head_dim * positions * torch.finfo(dtype).bits // 8


@torch.no_grad()
def profile_forward(handle: Any, precision: str, ks: Sequence[int] = DEFAULT_KS, *, context: int = 300,
                    reps: int = 8, seed: int = 0) -> list[ForwardProfile]:
    """Profile verify passes of each k in ``ks`` after a ``context``-token prompt (random tokens:
    the cost does not depend on which) on ``handle``'s model; see the module docstring."""
    from ..models.growing_cache import growing_cache

    model = handle.model
    invariant = bool(getattr(model, "batch_invariant", False))
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    prompt = torch.randint(100, vocab, (1, context), generator=g, device=handle.device)
    cache = model.new_cache() if invariant else growing_cache(model.config.num_hidden_layers)  # the decoder's
    extra = {"prompt_rows": context} if invariant else {}
    model(input_ids=prompt, cache=cache, use_cache=True, logits_to_keep=1, **extra)
    weights = _weight_bytes(model)
    rows: list[ForwardProfile] = []

    def verify(x: torch.Tensor) -> None:
        model(input_ids=x, cache=cache, use_cache=True, logits_to_keep=x.shape[1], **({"prompt_rows": 0} if invariant else {}))
        cache.crop(-x.shape[1])

    for k in ks:
        x = torch.randint(100, vocab, (1, k), generator=g, device=handle.device)
        verify(x)  # warm: kernel choice, allocations
        plain = []
        for _ in range(reps):
            t0 = time.perf_counter()
            verify(x)
            plain.append((time.perf_counter() - t0) * 1000)
        timer = _PartTimer(model)
        stack = getattr(model, "model", None)
        flat = getattr(stack, "native_decode", None) or getattr(stack, "gguf_decode", None)
        if flat is not None:  # hooks see modules: the hooked run takes transformers' forward
            flat.enabled = False
        try:
            t0 = time.perf_counter()
            for _ in range(reps):
                verify(x)
            hooked = (time.perf_counter() - t0) * 1000
        finally:
            timer.remove()
            if flat is not None:
                flat.enabled = True
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(2):
                verify(x)
        conv_us = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in ("aten::_to_copy", "aten::copy_"))
        total = statistics.median(plain)
        parts = {p: total * ms / hooked for p, ms in timer.ms.items()}  # shares of the hooked run
        parts["other"] = max(0.0, total - sum(parts.values()))
        rows.append(ForwardProfile(precision, k, context, total, parts, conv_us / 2 / 1000, weights / 1e6,
                                   _kv_bytes(model, context + k) / 1e6))
    return rows
