"""The logits a step reads, computed only over the tokens the constraint lets a position use.

The vocabulary projection reads the whole output matrix for every row it computes, the largest
single cost of a decode step on the embedded model (see docs/performance.md). Yet many of the
positions whose logits a structured output reads allow only a few tokens: digits, an enum's
values, ``true``/``false``, a comma or a closing bracket. A row in such a state gets its
logits from those rows of the matrix alone (``allowed_subset``), the others from the model's
own output layer; a step whose rows are all small or forced skips the full projection.

Exactness. Which path a row takes depends only on its constraint state (the number of tokens
the state allows), never on K, the other rows or the batch, and a row on the subset path is
computed alone, so a position's logits have the same bits in target-only decoding, in any
verify pass and in any batch: greedy identity and the batch invariance hold on either path. The
tokens outside the subset are the ones the mask sets to -inf anyway, so the masked law is the
model's on the allowed tokens (up to the rounding of a different summation order).

Models whose logits are more than a plain output layer of the final hidden state (a final
softcap, a logit scale, another kind of layer, a hook on it) keep the full projection
(``supports_subsets``), and so do models on a GPU: there the whole matrix is read in
microseconds, while each subset row is a transfer of
its ids, a gather, a product and a copy back, each waiting on the last.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Sequence

import torch
from torch import nn

from .bucketed_linear import BucketedLinear
from .q8_output import Q8OutputProjection
from .quant_linear import QuantLinear

#: States allowing more tokens than this take the full projection: gathering a row of the
#: matrix costs about what reading it costs, so past a few thousand rows the subset stops paying
#: (1,024 rows: 2.4 MB, a fiftieth of the matrix).
SUBSET_MAX = 1024


def supports_subsets(target: Any) -> bool:
    """Whether ``target``'s logits are its output layer applied to the final hidden state, so a
    subset of rows can be computed on its own."""
    config = getattr(target, "config", None)
    out = target.get_output_embeddings() if hasattr(target, "get_output_embeddings") else None
    layers = [out, getattr(out, "linear", None)] if isinstance(out, BucketedLinear) else [out]
    plain = all(isinstance(m, nn.Linear) or type(m) in (BucketedLinear, Q8OutputProjection, QuantLinear) for m in layers)
    hooked = any(m._forward_hooks or m._forward_pre_hooks for m in layers if isinstance(m, nn.Module))
    on_gpu = out is not None and any(p.device.type == "cuda" for p in out.parameters())
    return (out is not None and plain and not hooked and not on_gpu and hasattr(target, "base_model")
            and getattr(config, "final_logit_softcapping", None) is None
            and getattr(config, "logits_scaling", 1.0) in (1, 1.0, None)
            and getattr(config, "logit_scale", 1.0) in (1, 1.0, None))


def allowed_subset(mask: torch.Tensor) -> torch.Tensor | None:
    """The token ids ``mask`` allows when they are few enough for the subset path (2 to
    ``SUBSET_MAX``), else None. A state allowing one token needs no logits at all."""
    count = int(mask.sum())
    if count < 2 or count > SUBSET_MAX:
        return None
    return mask.nonzero().flatten()


def forward_logits(target: Any, rows: Sequence[int], subsets: Sequence[torch.Tensor | None] | None,
                   use_subsets: bool, vocabulary: "VocabularyRows | None" = None,
                   **inputs: Any) -> tuple[Any, torch.Tensor]:
    """One forward of ``target`` on ``inputs`` (``input_ids``, ``cache``, ...) and the logits of
    positions ``rows`` ``[len(rows), V]`` on the CPU (float32, or float64 where the model
    computes in it): over ``subsets`` (``project_rows``, the other rows over ``vocabulary``
    where given) when ``use_subsets``, else through the model's forward with
    ``logits_to_keep``. Returns (the forward's output, the logits)."""
    if use_subsets:
        out = target.base_model(**inputs)
        subsets = subsets if subsets is not None else [None] * len(rows)
        return out, project_rows(target, out.last_hidden_state[0, list(rows)], subsets, vocabulary)
    device = inputs["input_ids"].device
    out = target(**inputs, logits_to_keep=torch.tensor(list(rows), dtype=torch.long, device=device))
    logits = out.logits[0].cpu()
    return out, logits if logits.dtype == torch.float64 else logits.float()


def project_rows(target: Any, hidden: torch.Tensor, subsets: Sequence[torch.Tensor | None],
                 vocabulary: "VocabularyRows | None" = None) -> torch.Tensor:
    """Logits ``[n, V]`` (float32, or float64 where the model computes in it, on the CPU) of the
    final hidden states ``hidden`` ``[n, d]``: row ``i`` over the ids ``subsets[i]`` (zeros
    elsewhere, which the mask removes), or where it is None over ``vocabulary``'s rows (-inf
    elsewhere: a draft vocabulary) or, without one, over the whole vocabulary (through the model's
    own output layer, all such rows in one call, as the model's forward does)."""
    linear, rows_of, dtype, device, vocab = _output_layer(target, hidden.device)
    logits = torch.zeros(len(subsets), vocab, dtype=dtype)
    full = [i for i, s in enumerate(subsets) if s is None]
    if full and vocabulary is not None:
        logits[full] = vocabulary.logits(hidden[full]).to(dtype)
    elif full:
        logits[full] = target.get_output_embeddings()(hidden[full][None])[0].to(dtype).cpu()
    bias = getattr(linear, "bias", None)
    for i, ids in enumerate(subsets):
        if ids is None:
            continue
        ids_dev = ids.to(device)
        rows = rows_of(ids_dev)
        row = torch.mv(rows, hidden[i].to(rows.dtype))
        if bias is not None:
            row = row + bias.index_select(0, ids_dev)
        logits[i, ids] = row.to(dtype).cpu()
    return logits


def _output_layer(target: Any, device: torch.device) -> tuple[nn.Module, Callable[[torch.Tensor], torch.Tensor],
                                                              torch.dtype, torch.device, int]:
    """The model's output layer (unwrapped), a reader of its rows (float32 for a packed one,
    exactly as the file stores them), the logits' dtype, the rows' device and the vocabulary size."""
    out = target.get_output_embeddings()
    linear = out.linear if isinstance(out, BucketedLinear) else out  # the wrapper has no bias of its own
    if isinstance(linear, QuantLinear):
        return linear, linear.gather_rows, torch.float32, device, linear.out_features
    weight = linear.weight
    dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
    return linear, (lambda ids: weight.index_select(0, ids)), dtype, weight.device, weight.shape[0]


class VocabularyRows:
    """A fixed set of a model's output rows (a draft vocabulary: the tokens a draft may propose
    where a state allows many) as a layer of its own, so a draft step reads those rows of the
    output matrix instead of all of them (docs/draft-models.md: the projection is a quarter to
    two fifths of a 0.5B model's step over Qwen's 151,936 rows). A packed layer keeps its form
    (``QuantLinear.take_rows``); a request's extra rows (its prompt's tokens) are float32 rows
    beside it (``with_tokens``). Logits outside the rows are -inf: a draft cannot propose them."""

    def __init__(self, target: Any, ids: torch.Tensor | Sequence[int]) -> None:
        self.target = target
        linear, rows_of, self.dtype, device, self.vocab_size = _output_layer(target, torch.device("cpu"))
        self.ids = torch.unique(torch.as_tensor(ids, dtype=torch.int64).reshape(-1))
        if self.ids.numel() and (int(self.ids[0]) < 0 or int(self.ids[-1]) >= self.vocab_size):
            raise IndexError(f"Vocabulary ids must lie in 0..{self.vocab_size - 1}.")
        self.layer: Callable[[torch.Tensor], torch.Tensor]
        if isinstance(linear, QuantLinear):
            self.layer = linear.take_rows(self.ids)
        else:
            self.layer = _dense_rows(rows_of(self.ids.to(device)), _bias_rows(linear, self.ids.to(device)))
        self.member = torch.zeros(self.vocab_size, dtype=torch.bool)
        self.member[self.ids] = True
        #: A request's extra rows: their ids and their layer (``with_tokens``).
        self.extra: tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]] | None = None

    @classmethod
    def leading(cls, target: Any, size: int) -> "VocabularyRows":
        """The rows of the first ``size`` token ids (all of them where the vocabulary is smaller)."""
        return cls(target, torch.arange(min(size, _output_layer(target, torch.device("cpu"))[4])))

    def __len__(self) -> int:
        return int(self.member.sum())

    def with_tokens(self, tokens: Sequence[int]) -> "VocabularyRows":
        """These rows and those of ``tokens`` not among them (gathered once, float32), sharing
        this one's layer."""
        ids = torch.unique(torch.as_tensor(list(tokens), dtype=torch.int64))
        ids = ids[(ids >= 0) & (ids < self.vocab_size)]
        ids = ids[~self.member[ids]]
        if not ids.numel():
            return self
        linear, rows_of, _, device, _ = _output_layer(self.target, torch.device("cpu"))
        wider = copy.copy(self)
        wider.extra = (ids, _dense_rows(rows_of(ids.to(device)), _bias_rows(linear, ids.to(device))))
        wider.member = self.member.clone()
        wider.member[ids] = True
        return wider

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, V]`` on the CPU: these rows' logits of the final hidden states ``hidden``
        ``[n, d]``, -inf elsewhere."""
        out = torch.full((hidden.shape[0], self.vocab_size), float("-inf"), dtype=self.dtype)
        out[:, self.ids] = self.layer(hidden).to(self.dtype).cpu()
        if self.extra is not None:
            ids, layer = self.extra
            out[:, ids] = layer(hidden).to(self.dtype).cpu()
        return out


def _dense_rows(rows: torch.Tensor, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda h: nn.functional.linear(h.to(rows.dtype), rows, None if bias is None else bias.to(rows.dtype))


def _bias_rows(linear: nn.Module, ids: torch.Tensor) -> torch.Tensor | None:
    bias = getattr(linear, "bias", None)
    return None if bias is None else bias.index_select(0, ids)
