"""The target's own layers as its draft (self-speculation): a view of a loaded model's decoder
stack that runs only some of its layers, over the same weights and the same KV cache.

A layer keeps its index, so in a cache made for the whole model (``new_cache()``) the view reads
and writes exactly the layers it runs: over a cache the whole model filled, its layers attend to
the whole model's keys and values of the context, as a draft sharing the target's cache would.
The view runs transformers' own forward of the stack: a faster loop installed on the model
(``models.gguf_decode``, ``models.native_decode``, ``models.cuda_graphs`` replace the stack's
``forward`` on the instance) runs every layer, so the view drops it.
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

from torch import nn

#: Instance attributes a faster decode loop leaves on the decoder stack (see the docstring).
_LOOP_ATTRIBUTES = ("forward", "gguf_decode", "native_decode", "graphed")


def layer_subset(model: Any, layers: Sequence[int]) -> nn.Module:
    """A decoder stack sharing ``model``'s modules (``model.base_model``: embeddings, final norm)
    that runs only ``layers`` (indices into its layers, ascending, no repeats), each at its own
    index in the cache. Its ``last_hidden_state`` is normed as the whole stack's: the model's
    output layer turns it into logits."""
    base = model.base_model
    count = len(base.layers)
    chosen = list(layers)
    if not chosen or chosen != sorted(set(chosen)) or chosen[0] < 0 or chosen[-1] >= count:
        raise ValueError(f"A layer subset needs ascending, distinct layer indices in 0..{count - 1}, got {chosen}.")
    view = copy.copy(base)
    for name in _LOOP_ATTRIBUTES:
        view.__dict__.pop(name, None)
    view._modules = dict(base._modules)  # its own module table: the model's keeps all its layers
    view._modules["layers"] = nn.ModuleList([base.layers[i] for i in chosen])
    return view
