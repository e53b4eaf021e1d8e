"""The benchmark harnesses behind ``constrained-spec bench SUBCOMMAND``, ``coverage``, ``fuzz`` and
``soak``, one module each; every one prints figures measured side by side in one run (kept in
the docs: docs/benchmarks.md says which page holds which):

- ``single``: one request at a time, target-only against every drafter and K policy, with
  outlines' generator and llama.cpp's grammar path as reference rows (``quality`` scores the
  fields);
- ``batch``: batched extraction at each batch size; ``serve``: load on a running server;
  ``long_prompt``: a long document beside short requests, and one document under several schemas;
  ``documents``: long real documents one cold request each (prompt rate, time to first token);
  ``neighbour``: a request with a busy process beside it; ``forward_profile``: where a forward's
  time goes;
- ``coverage`` (with ``instances``): how much of a schema corpus compiles and accepts its own
  examples; ``hostile`` and ``soak``: bad and mixed traffic against a server.

The prompts and documents they run on ship in ``constrained_spec/data`` (``documents`` reads the
installed packages' own descriptions).
Nothing is re-exported here, so each harness stays its module."""
