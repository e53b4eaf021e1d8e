"""CUDA graphs for a batch-invariant model's decode and verify forwards on a GPU.

A forward of a small model on a GPU is bound by launching kernels, not by running them, the
more so made batch-invariant (``models.invariant`` adds float64 norms and attention, so more
launches), while its weights take microseconds to read. A CUDA graph replays a recorded sequence
of kernels with one launch (docs/performance.md, CUDA graphs, has the figures).

A graph replays fixed shapes on fixed addresses, so what it records is a *static* forward:
- rows: the forward's new tokens are padded to a bucket of ``ROW_BUCKETS`` rows (token 0 at
  the positions after them). Padding changes no bit of the real rows: every linear layer
  already computes its rows in zero-padded blocks of ``bucketed_linear.ROW_BUCKET`` rows (so the
  buckets stop there), norms are per row, and attention is causal, so a real row never sees
  a padded one;
- keys: attention reads a bucket of ``keys`` positions (a power of two from ``MIN_KEYS``) of
  the graph runner's own key and value buffers, with a mask built inside the graph from the
  rows' positions. The positions past the held ones are masked; the padded rows' keys are
  written there and overwritten by the next real ones;
- the KV cache: the runner owns one float64 buffer per layer, grown by doubling as requests
  need (from ``FIRST_BUFFER`` positions up to the model's context; a growth drops the graphs,
  which read the old buffers), and the request whose forward it runs *holds* them: its
  ``GrowingLayer``s are moved into them (``GrowingLayer.move_into``), so a step writes its
  keys in place and a rollback is still a length. Another request's forward moves the holder
  out into buffers of its own first; one request at a time is the single-request decoder's
  case, so that copy happens once a request.
Everything else is the model's own modules called as its forward calls them (the decoder
layers, with the batch-invariant norms, attention and bucketed linear layers), so the bits are
the eager path's: each row sees the same kernels on the same row blocks. The attention over a
key bucket instead of the held keys sums the same products in float64 with masked zeros added,
which the rounding to float32 absorbs (``models.invariant``'s argument); the GPU check counts
the values that differ from the eager forward (``benchmarks/gpu_check.py``).

Which forwards: one row of the batch, 1 to ``ROW_BUCKETS[-1]`` new tokens, no prompt rows, no
attention mask or explicit positions, no gradient, a request cache of ``GrowingLayer``s in
float64 (what the decoder gives a batch-invariant model), and room for the bucket's rows in the
buffers. Everything else (prompt passes, packed batch steps, a longer context) takes the eager
forward, as do all forwards where no GPU is present: the CPU path is unchanged.

Cost: each (rows, keys) bucket is captured the first time a forward needs it: a warm-up
forward and a recorded one, about two eager forwards. A request over a few hundred positions
with K up to 12 meets five or six buckets, so the first request pays for them and later ones
nothing. The graphs share one memory pool.
"""

from __future__ import annotations

import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

#: Row buckets of a graphed forward (at most ``bucketed_linear.ROW_BUCKET``: the linear layers' block).
ROW_BUCKETS = (1, 2, 4, 8, 16, 32)
#: The smallest key bucket; the others double up to the runner's capacity.
MIN_KEYS = 256
#: The most positions the runner's buffers hold when the model's config states no context.
DEFAULT_CAPACITY = 8192
#: Decoder stacks whose forward is exactly what ``_static_forward`` replays (embeddings, rotary
#: embedding, the layers under one causal mask, the final norm). Others differ outside their
#: layers (Gemma scales its embeddings, Mistral masks a sliding window) and keep the eager forward.
GRAPHED_STACKS = ("LlamaModel",)
#: Positions the runner's buffers hold at first. Why not the whole context at once: keys and
#: values in float64, 8 bytes a number, for a long-context model's whole window are gigabytes
#: that most requests never use.
FIRST_BUFFER = 1024


def row_bucket(rows: int) -> int | None:
    """The smallest row bucket of ``rows`` new tokens (None: more than the largest)."""
    return next((b for b in ROW_BUCKETS if b >= rows), None)


def key_bucket(positions: int, capacity: int) -> int | None:
    """The smallest key bucket (``MIN_KEYS`` doubling, the last one ``capacity``) holding
    ``positions``; None when they do not fit ``capacity``."""
    if positions > capacity:
        return None
    keys = MIN_KEYS
    while keys < positions:
        keys *= 2
    return min(keys, capacity)


class _StaticKV:
    """The cache a static forward's attention layers write to: each layer's new keys and values
    go into the runner's buffers at the rows' positions (``index_copy_``: positions are a
    tensor, so a graph serves every step), and attention reads the first ``keys`` positions."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], positions: torch.Tensor,
                 span: int) -> None:
        self.keys, self.values, self.positions, self.span = keys, values, positions, span

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``Cache.update`` for the static forward (bfloat16 -> float64 is exact, as in ``GrowingLayer``)."""
        k, v = self.keys[layer_idx], self.values[layer_idx]
        k.index_copy_(2, self.positions, key_states.to(k.dtype))
        v.index_copy_(2, self.positions, value_states.to(v.dtype))
        return k[:, :, : self.span], v[:, :, : self.span]


@dataclass
class GraphStats:
    """What the runner did since it was installed (for the bench and the GPU check)."""

    #: Forwards the static path computed (replayed from a graph where capturing).
    served: int = 0
    #: Times the buffers grew (each drops the graphs captured on the old ones).
    grows: int = 0
    captures: int = 0
    capture_seconds: float = 0.0
    #: Forwards left to the eager path.
    eager: int = 0
    moves: int = 0
    buckets: list[tuple[int, int]] = field(default_factory=list)


class GraphedDecode:
    """Static decode and verify forwards of one batch-invariant llama-family model, captured as
    CUDA graphs per (rows, keys) bucket and replayed (see the module docstring).

    ``capture=False`` runs the same static forward without recording it (no GPU needed): how
    the CPU tests check its bits, its buckets and the buffers' hand-over."""

    def __init__(self, model: Any, *, capacity: int | None = None, capture: bool | None = None) -> None:
        self.model = model
        self.base = model.base_model
        config = model.config
        first = next(self.base.parameters())
        self.device = first.device
        self.capture = self.device.type == "cuda" if capture is None else capture
        #: The most positions a graphed forward reaches (its rows included).
        self.capacity = int(capacity or getattr(config, "max_position_embeddings", None) or DEFAULT_CAPACITY)
        self.layers = list(self.base.layers[: config.num_hidden_layers])
        self._kv_shape = (config.num_key_value_heads, self.layers[0].self_attn.head_dim)
        #: Each layer's key and value buffers (float64: what the decoder's cache holds for a
        #: batch-invariant model, exact copies), allocated at the first forward (``_room``).
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._ids = torch.zeros(1, ROW_BUCKETS[-1], dtype=torch.long, device=self.device)
        self._positions = torch.zeros(1, ROW_BUCKETS[-1], dtype=torch.long, device=self.device)
        self._graphs: dict[tuple[int, int], tuple[Any, list[torch.Tensor]]] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None
        self._holder: weakref.ReferenceType[Any] | None = None
        self._lock = threading.Lock()
        #: Off: every forward takes the eager path (the GPU check's control).
        self.enabled = True
        self.stats = GraphStats()

    # -- which forwards ------------------------------------------------------------------------

    def serves(self, cache: Any, rows: int) -> tuple[int, int] | None:
        """The (rows, keys) bucket of a plain forward of ``rows`` new tokens after ``cache``'s
        positions, or None where it takes the eager path."""
        if not self.enabled or rows < 1:
            return None
        layers = getattr(cache, "layers", None)
        if not layers or len(layers) != len(self.layers) or not all(
                hasattr(la, "move_into") and la.store_dtype == torch.float64 and la.get_seq_length() > 0
                for la in layers):
            return None
        bucket = row_bucket(rows)
        if bucket is None:
            return None
        past = layers[0].get_seq_length()
        # The padded rows' keys are written too: the whole bucket must fit the buffers.
        keys = key_bucket(past + bucket, self.capacity)
        return None if keys is None else (bucket, keys)

    def _room(self, keys: int) -> None:
        """Buffers of at least ``keys`` positions: grown by doubling (from ``FIRST_BUFFER``, at
        most ``capacity``), the old buffers' graphs dropped."""
        held = self.keys[0].shape[2] if self.keys else 0
        if keys <= held:
            return
        size = max(FIRST_BUFFER, 2 * held)
        while size < keys:
            size *= 2
        size = min(size, self.capacity)
        shape = (1, self._kv_shape[0], size, self._kv_shape[1])
        # The holder keeps the old buffers as its own (nothing is lost); ``_hold`` moves the
        # request under way into the new ones.
        self.keys, self.values = ([torch.zeros(shape, dtype=torch.float64, device=self.device) for _ in self.layers]
                                  for _ in range(2))
        self._graphs.clear()
        self.stats.grows += bool(held)

    def _hold(self, cache: Any) -> None:
        """Make ``cache``'s layers hold the runner's buffers, moving the previous holder's
        positions out into buffers of its own first."""
        if all(la.holds(k) for la, k in zip(cache.layers, self.keys)):
            return
        previous = self._holder() if self._holder is not None else None
        if previous is not None and previous is not cache:
            for layer, k in zip(previous.layers, self.keys):
                if layer.holds(k):
                    layer.move_into()
        for layer, k, v in zip(cache.layers, self.keys, self.values):
            layer.move_into(k, v)
        self._holder = weakref.ref(cache)
        self.stats.moves += 1

    # -- the static forward ----------------------------------------------------------------------

    def _static_forward(self, rows: int, keys: int) -> list[torch.Tensor]:
        """The model's forward of the ``rows`` tokens in ``_ids`` at ``_positions``, attending
        over the first ``keys`` buffer positions; the hidden states as transformers'
        ``output_hidden_states`` gives them (the embeddings, each block's output, the last normed)."""
        base = self.base
        ids, positions = self._ids[:, :rows], self._positions[:, :rows]
        x = base.embed_tokens(ids)
        position_embeddings = base.rotary_emb(x, positions)
        # Each row sees the keys up to its own position (padding positions past the held ones).
        allowed = (torch.arange(keys, device=self.device)[None, :] <= positions[0, :, None])[None, None]
        kv = _StaticKV(self.keys, self.values, positions[0], keys)
        states = [x]
        for layer in self.layers:
            x = layer(x, attention_mask=allowed, position_ids=positions, cache=kv, use_cache=True,
                      position_embeddings=position_embeddings)
            states.append(x)
        states[-1] = base.norm(x)
        return states

    def _graph(self, rows: int, keys: int) -> tuple[Any, list[torch.Tensor]]:
        """The captured graph of a bucket and its output tensors (captured at first use)."""
        hit = self._graphs.get((rows, keys))
        if hit is not None:
            return hit
        t0 = time.perf_counter()
        # Warm up on a side stream first (cuBLAS handles and workspaces are made outside the
        # capture), as torch.cuda.graph's documentation asks. It writes keys past the held
        # positions only, which the mask hides and the next step overwrites.
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._static_forward(rows, keys)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            outputs = self._static_forward(rows, keys)
        self._graphs[(rows, keys)] = (graph, outputs)
        self.stats.captures += 1
        self.stats.capture_seconds += time.perf_counter() - t0
        self.stats.buckets.append((rows, keys))
        return graph, outputs

    @torch.no_grad()
    def run(self, input_ids: torch.Tensor, cache: Any, bucket: tuple[int, int],
            hidden: bool) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None] | None:
        """Feed ``input_ids`` ``[1, n]`` after ``cache``'s positions through the bucket's static
        forward (replayed from its graph where capturing); returns the final hidden states
        ``[1, n, d]`` and, with ``hidden``, every layer's (as ``output_hidden_states``). None
        where the graph could not be captured: nothing was fed, the runner is off from then
        on (with a warning), and the caller takes the eager forward."""
        rows, keys = bucket
        n = input_ids.shape[1]
        with self._lock:
            self._room(keys)
            self._hold(cache)
            past = cache.layers[0].get_seq_length()
            self._ids[:, :n].copy_(input_ids)
            self._ids[:, n:rows].zero_()
            self._positions[0, :rows].copy_(torch.arange(past, past + rows))
            if self.capture:
                try:
                    graph, outputs = self._graph(rows, keys)
                except RuntimeError as e:  # a model or a torch whose forward cannot be recorded
                    self.enabled = False
                    warnings.warn(f"CUDA graphs are off for this model: capturing its forward failed ({e}); "
                                  "its forwards run eagerly, with the same results.", stacklevel=4)
                    return None
                graph.replay()
            else:
                outputs = self._static_forward(rows, keys)
            self.stats.served += 1
            for layer in cache.layers:
                layer.advance(n)
            # Copies: the graph's outputs are overwritten by its next replay.
            last = outputs[-1][:, :n].clone()
            states = tuple(o[:, :n].clone() for o in outputs[:-1]) + (last,) if hidden else None
        return last, states


def install_cuda_graphs(model: Any, *, capacity: int | None = None, capture: bool | None = None) -> GraphedDecode | None:
    """Give a batch-invariant ``model`` (``models.invariant``) graphed decode and verify forwards
    (in place; see the module docstring); returns the runner (``model.base_model.graphed``), or
    None where the model is not batch-invariant, its decoder stack is not one of
    ``GRAPHED_STACKS``, or, with ``capture`` unset, it is not on a GPU."""
    from transformers.modeling_outputs import BaseModelOutputWithPast

    from .native_decode import plain_forward

    if not getattr(model, "batch_invariant", False) or type(getattr(model, "base_model", None)).__name__ not in GRAPHED_STACKS:
        return None
    if capture is None and next(model.parameters()).device.type != "cuda":
        return None
    base = model.base_model
    runner = GraphedDecode(model, capacity=capacity, capture=capture)
    stock = base.forward

    def forward(input_ids: torch.Tensor | None = None, cache: Any = None, use_cache: bool | None = None,
                output_hidden_states: bool | None = None, **kwargs: Any) -> Any:
        bucket = None
        if plain_forward(input_ids, cache, use_cache, kwargs):
            bucket = runner.serves(cache, input_ids.shape[1])
        out = runner.run(input_ids, cache, bucket, bool(output_hidden_states)) if bucket is not None else None
        if out is None:
            runner.stats.eager += 1
            return stock(input_ids=input_ids, cache=cache, use_cache=use_cache, output_hidden_states=output_hidden_states,
                         **kwargs)
        last, states = out
        return BaseModelOutputWithPast(last_hidden_state=last, cache=cache, hidden_states=states)

    base.forward = forward
    base.graphed = runner
    return runner
