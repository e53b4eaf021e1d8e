"""The batch engine: many requests decoded together, one packed target forward a step.

Data flow: ``engine`` composes a ``scheduler`` (policy: admission against the KV memory bound,
prefill turns, the draft budget) and a ``runner`` (mechanism: packing, the forward, unpacking),
with each row's own drafters, K policy and verifier from ``constrained_spec.decoding`` planning
and finishing its step; ``packing`` lays every row's new tokens into one
sequence and gives attention each row's own keys; ``cache`` holds the rows' keys and values on
shelves bounded in bytes; ``budget`` prices a step so drafts and prompt chunks share it;
``drafting`` decides whether a step drafts at all, drafting's own cost included (freed shelves'
memory goes back to the system through ``models.heap``). The prompt-block prefix cache lives in
``decoding.prefix``, because the single-request decoder uses it too.
"""

from .cache import RowCache
from .engine import BatchEngine, Request

__all__ = ["BatchEngine", "Request", "RowCache"]
