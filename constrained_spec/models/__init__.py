"""Models: loading (a Hugging Face id or path, a loaded pair, or the embedded default) and the
embedded GGUF at its native precision (``native``: Q4_1 linear layers on the int4 kernel)."""

from .loading import (
    DEFAULT_MODEL_FILE,
    DEFAULT_MODEL_INSTALL,
    DEFAULT_MODEL_NAME,
    PRECISIONS,
    ModelHandle,
    check_same_tokenizer,
    default_dtype,
    load_model,
    resolve_model,
    warm_up,
)

__all__ = [
    "DEFAULT_MODEL_FILE", "DEFAULT_MODEL_INSTALL", "DEFAULT_MODEL_NAME", "PRECISIONS", "ModelHandle",
    "check_same_tokenizer", "default_dtype", "load_model", "resolve_model", "warm_up",
]
