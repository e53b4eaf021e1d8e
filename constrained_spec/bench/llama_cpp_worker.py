"""llama.cpp's grammar path in a process of its own, driven over stdin / stdout by the bench.

Why a separate process: an outside engine's crash should cost its row, not the whole run (a
native build of llama-cpp-python has crashed in its AMX matmul; the build that avoids it is in
docs/benchmarks.md), and llama.cpp and torch each bring an OpenMP runtime. The file runs by
path, not as a module of the package, so nothing of torch is imported here; the bench times
each call from its side, round trip included (a pipe's latency is negligible against a request).

Protocol, one JSON object a line each way:
``{"op": "grammar", "schema": {...}}`` -> ``{"id": N}`` (a grammar built from the JSON schema);
``{"op": "generate", "grammar": N, "ids": [...], "max_tokens": M}`` -> ``{"text": "..."}`` (``"grammar": null``:
unconstrained, llama.cpp's plain decoding); with ``"timings": true`` the text is streamed and
the reply also has ``first_token_s`` (from the call to its first piece of text), ``seconds``,
``tokens`` (pieces streamed) and ``prompt_eval_s`` (llama.cpp's own prompt-evaluation timer; null
where this build does not expose it), all timed inside this process;
an error -> ``{"error": "..."}``. End of input ends the process.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def serve(model_path: str, n_threads: int, n_ctx: int = 4096) -> None:
    """Answer requests on stdin until it closes (see the module docstring)."""
    from llama_cpp import Llama, LlamaGrammar

    llm = Llama(model_path=model_path, n_ctx=n_ctx, n_threads=n_threads, verbose=False)
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
                if msg.get("timings"):
                    reply = _timed_generate(llm, msg["ids"], grammar, msg["max_tokens"])
                else:
                    out = llm(msg["ids"], grammar=grammar, max_tokens=msg["max_tokens"], temperature=0.0)
                    reply = {"text": out["choices"][0]["text"]}
        except Exception as e:  # noqa: BLE001  (reported to the bench, which leaves the prompt out)
            reply = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(reply), flush=True)


def _timed_generate(llm: Any, ids: list[int], grammar: Any, max_tokens: int) -> dict[str, Any]:
    """One generation, streamed so the first piece of text can be timed (see the module docstring)."""
    import llama_cpp

    ctx = getattr(getattr(llm, "_ctx", None), "ctx", None)  # the C context: its perf timers, where exposed
    perf = ctx is not None and hasattr(llama_cpp, "llama_perf_context")
    if perf:
        llama_cpp.llama_perf_context_reset(ctx)
    pieces: list[str] = []
    first = None
    t0 = time.perf_counter()
    for chunk in llm(ids, grammar=grammar, max_tokens=max_tokens, temperature=0.0, stream=True):
        if first is None:
            first = time.perf_counter() - t0
        pieces.append(chunk["choices"][0]["text"])
    seconds = time.perf_counter() - t0
    prompt_eval = llama_cpp.llama_perf_context(ctx).t_p_eval_ms / 1000 if perf else None
    return {"text": "".join(pieces), "first_token_s": first, "seconds": seconds, "tokens": len(pieces),
            "prompt_eval_s": prompt_eval}


if __name__ == "__main__":
    # The third argument, the context size, is optional: callers that predate it get 4096.
    serve(sys.argv[1], int(sys.argv[2]), *(int(a) for a in sys.argv[3:4]))
