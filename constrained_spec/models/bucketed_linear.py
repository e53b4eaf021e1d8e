"""Linear layers whose rows' bits do not depend on how many rows share the forward, and the
split of a forward's rows into prompt rows and new ones that they read (``models.invariant``'s
module docstring says why each piece is needed).

``RowSplit``: which rows of the forward under way are prompt rows, set from the forward's
``prompt_rows=`` by a hook on the decoder stack. ``BucketedLinear``: a linear layer whose new rows
go through the matmul in zero-padded blocks of one fixed size (``ROW_BUCKET``; the CPU output
projection ``OUTPUT_BUCKET`` rows as ``W @ X.T``), one kernel shape for every forward.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

#: Rows per matmul call of a ``BucketedLinear``: a verify pass holds the last token and at most
#: K_max drafts (12 on GPUs), so one block serves every step.
ROW_BUCKET = 32
#: Rows per block of the CPU output projection (``models.invariant``'s module docstring).
OUTPUT_BUCKET = 8


class RowSplit:
    """Which rows of the forward under way are prompt rows, shared by a model's routed linear
    layers and norms and set from the forward's ``prompt_rows=`` by a hook: an int (the
    sequence's leading rows, a request's own pass) or a list of ``(start, length)`` segments (a
    batch engine's packed step, where each joining request's prompt sits among other rows)."""

    __slots__ = ("segments",)

    def __init__(self) -> None:
        self.segments: list[tuple[int, int]] = []

    @property
    def prompt_rows(self) -> int:
        """Prompt rows in all (for tests and figures)."""
        return sum(n for _, n in self.segments)

    def install(self, model: Any) -> None:
        """Track ``prompt_rows`` on ``model``'s decoder stack (the output projection after it
        sees only output rows, so the segments are cleared once the stack is done)."""
        stack = getattr(model, "base_model", model)

        def enter(_module: Any, _args: Any, kwargs: dict[str, Any]) -> None:
            self.segments = prompt_segments(kwargs.get("prompt_rows"))

        def leave(*_: Any) -> None:
            self.segments = []

        stack.register_forward_pre_hook(enter, with_kwargs=True)
        stack.register_forward_hook(leave)

    def pieces(self, rows: int) -> list[tuple[int, int, bool]]:
        """``(start, end, is_prompt)`` runs covering rows ``0 .. rows - 1`` in order."""
        out, at = [], 0
        for start, length in self.segments:
            start, end = min(start, rows), min(start + length, rows)
            if start > at:
                out.append((at, start, False))
            if end > start:
                out.append((start, end, True))
            at = max(at, end)
        if at < rows:
            out.append((at, rows, False))
        return out

    def apply(self, x: torch.Tensor, prompt: Callable[[torch.Tensor], torch.Tensor],
              new: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``prompt`` on each prompt segment of ``x`` (``[..., seq, d]``, along ``seq``), ``new``
        on the other rows (all at once when they are contiguous), results in row order."""
        pieces = self.pieces(x.shape[-2]) if x.dim() >= 2 else [(0, 0, False)]
        if not pieces or len(pieces) == 1:  # no rows, or all of one kind: no split, no copy
            return (prompt if pieces and pieces[0][2] else new)(x)
        if sum(not p for _, _, p in pieces) <= 1:  # new rows in one run, if any
            return torch.cat([(prompt if p else new)(x[..., s:e, :]) for s, e, p in pieces], dim=-2)
        # New rows in several runs (a packed step): one call over all of them, then interleave.
        new_idx = torch.cat([torch.arange(s, e) for s, e, p in pieces if not p]).to(x.device)
        out_new = new(x.index_select(-2, new_idx))
        parts, at = [], 0
        for s, e, p in pieces:
            if p:
                parts.append(prompt(x[..., s:e, :]))
            else:
                parts.append(out_new[..., at : at + e - s, :])
                at += e - s
        return torch.cat(parts, dim=-2)


def prompt_segments(prompt_rows: int | list[tuple[int, int]] | None) -> list[tuple[int, int]]:
    """``prompt_rows=`` as ``(start, length)`` segments."""
    if not prompt_rows:
        return []
    if isinstance(prompt_rows, int):
        return [(0, prompt_rows)]
    return [(int(s), int(n)) for s, n in prompt_rows if n]


class BucketedLinear(nn.Module):
    """A linear layer whose non-prompt rows go through the matmul in zero-padded blocks of exactly
    ``bucket`` rows, so each row's result does not depend on how many rows the forward has
    (see the module docstring). Prompt rows take one plain matmul. Same parameters as the layer.
    ``transposed``: compute each block as ``W @ X.T`` (the CPU output projection)."""

    def __init__(self, linear: nn.Linear, rows: RowSplit, *, bucket: int = ROW_BUCKET, transposed: bool = False) -> None:
        super().__init__()
        self.linear = linear
        self.rows = rows
        self.bucket = bucket
        self.transposed = transposed

    @property
    def weight(self) -> torch.Tensor:
        """The wrapped layer's weight (transformers reads the output embeddings' weight)."""
        return self.linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., K]`` -> ``[..., N]``."""
        return self.rows.apply(x, self.linear, self._bucketed)

    def _bucketed(self, new: torch.Tensor) -> torch.Tensor:
        flat = new.reshape(-1, new.shape[-1])
        n = flat.shape[0]
        if n == 0:  # a forward whose rows all have one allowed token asks for no logits
            return self.linear(new)
        padded = torch.nn.functional.pad(flat, (0, 0, 0, -n % self.bucket))
        blocks = padded.split(self.bucket)
        if self.transposed:
            w, bias = self.linear.weight, self.linear.bias
            out = torch.cat([torch.mm(w, block.t()).t() for block in blocks])[:n]
            if bias is not None:
                out = out + bias
        else:
            out = torch.cat([self.linear(block) for block in blocks])[:n]
        return out.reshape(*new.shape[:-1], out.shape[-1])
