"""llama.cpp's grammar path in a process of its own, driven over stdin / stdout by the bench.

Why a separate process: an outside engine's crash should cost its row, not the whole run (a
native build of llama-cpp-python has crashed in its AMX matmul; the build that avoids it is in
docs/benchmarks.md), and llama.cpp and torch each bring an OpenMP runtime. The file runs by
path, not as a module of the package, so nothing of torch is imported here; the bench times
each call from its side, round trip included (a pipe's latency is negligible against a request).

Protocol, one JSON object a line each way:
``{"op": "grammar", "schema": {...}}`` -> ``{"id": N}`` (a grammar built from the JSON schema);
``{"op": "generate", "grammar": N, "ids": [...], "max_tokens": M}`` -> ``{"text": "..."}`` (``"grammar": null``:
unconstrained, llama.cpp's plain decoding);
an error -> ``{"error": "..."}``. End of input ends the process.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def serve(model_path: str, n_threads: int) -> None:
    """Answer requests on stdin until it closes (see the module docstring)."""
    from llama_cpp import Llama, LlamaGrammar

    llm = Llama(model_path=model_path, n_ctx=4096, n_threads=n_threads, verbose=False)
    llm([1, 2, 3], max_tokens=2, temperature=0.0)  # first-call allocations before any timing
    grammars: list[Any] = []
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        try:
            msg = json.loads(line)
            if msg["op"] == "grammar":
                grammars.append(LlamaGrammar.from_json_schema(json.dumps(msg["schema"]), verbose=False))
                reply: dict[str, Any] = {"id": len(grammars) - 1}
            else:
                llm.reset()  # no prompt reuse between calls
                grammar = None if msg["grammar"] is None else grammars[msg["grammar"]]
                out = llm(msg["ids"], grammar=grammar, max_tokens=msg["max_tokens"], temperature=0.0)
                reply = {"text": out["choices"][0]["text"]}
        except Exception as e:  # noqa: BLE001  (reported to the bench, which leaves the prompt out)
            reply = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]))
