"""An OpenAI-compatible server on the batch engine (``pip install constrained_spec[server]``).

``create_app(model)`` builds the FastAPI app; ``constrained-spec serve`` runs it with uvicorn.
"""

from .app import ServerConfig, create_app

__all__ = ["ServerConfig", "create_app"]
