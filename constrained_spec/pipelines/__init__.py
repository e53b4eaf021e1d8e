"""Pipelines built on the public API, one module each: ``extract`` (many documents, typed
records), ``bench`` (the side-by-side benchmark; its prompts ship in ``data/``), ``coverage``
(schema coverage over a corpus) and ``instances`` (does a language hold a JSON value).

Nothing is re-exported here, so ``constrained_spec.pipelines.extract`` stays the module."""
