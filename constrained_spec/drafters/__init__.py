"""Drafters: propose up to K tokens from the request's matcher state; the verifier decides.

One module each: ``lookup`` (prompt lookup), ``model`` (a draft LM), ``grammar`` (forced text),
``copy`` (copy a value from the prompt), ``corpus`` (the target's past outputs), ``head`` (a
learned head), ``hybrid`` (all of them in one draft, its parts ordered by ``order``); ``base``
holds the contract and the kinds, ``factory`` builds a drafter by name.
"""

from .base import Draft, Drafter, DraftKind, cut_to_constraint
from .copy import CopyDrafter
from .factory import DRAFTER_NAMES, build_drafter
from .grammar import GrammarDrafter
from .hybrid import HybridDrafter
from .lookup import LookupDrafter, structural_tokens
from .model import ModelDrafter

__all__ = [
    "CopyDrafter", "DRAFTER_NAMES", "Draft", "DraftKind", "Drafter", "GrammarDrafter", "HybridDrafter", "LookupDrafter",
    "ModelDrafter", "build_drafter", "cut_to_constraint", "structural_tokens",
]
