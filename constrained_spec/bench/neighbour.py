"""A request's time beside other processes: the harness of ``constrained-spec bench neighbour``
(figures in docs/performance.md, "Sharing the machine").

The same extraction prompts run alone, beside one busy core (a Python loop: a web worker, a
compiler) and beside a second torch process (matmuls on torch's default threads: an OpenMP
neighbour whose threads spin), for target-only and auto decoding with the thread governor
(``models.threads``, the default) and with torch's thread count left at its start ("fixed
threads"), and llama.cpp's grammar path as the outside reference (its threads = the cores, as
the bench runs it). Each figure is the time of the whole set of prompts and its ratio to the
same row alone; the neighbour starts a second before its runs and is killed after them. The
governor has sampled the load once before each run starts (as in a process that has been
running: it samples every 0.25 s), so a run's first interval is not spent at the most threads.
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

#: Neighbour processes by name (None: alone).
NEIGHBOURS: dict[str, list[str] | None] = {
    "alone": None,
    "one busy core": [sys.executable, "-c", "while True: pass"],
    "a torch process": [sys.executable, "-c", "import torch\nx = torch.randn(512, 512)\nwhile True: x @ x"],
}


@dataclass
class NeighbourRow:
    """One configuration's seconds for the prompts by neighbour."""

    config: str
    seconds: dict[str, float] = field(default_factory=dict)

    def ratios(self) -> dict[str, float]:
        """Each neighbour's time over the time alone."""
        alone = self.seconds.get("alone")
        return {k: v / alone for k, v in self.seconds.items()} if alone else {}

    def as_dict(self) -> dict[str, Any]:
        """The row as plain values (for ``--json``)."""
        return {"config": self.config, "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
                "slowdown": {k: round(v, 2) for k, v in self.ratios().items()}}


def run_neighbour_bench(limit: int = 3, max_new_tokens: int = 256, llama_cpp: bool = True,
                        progress: Callable[[str], None] = lambda _m: None) -> list[NeighbourRow]:
    """Time the first ``limit`` bench prompts in each configuration beside each neighbour."""
    from ..api import generate_json
    from ..models import threads
    from ..models.loading import load_model
    from .single import DEFAULT_PROMPTS, load_prompts

    handle = load_model()
    items = load_prompts(DEFAULT_PROMPTS, limit)
    start_threads = torch.get_num_threads()
    governor = threads.ThreadGovernor(start_threads)
    fixed = threads._Fixed(start_threads)
    llama_calls = _llama_calls(handle, items, max_new_tokens) if llama_cpp else []

    def ours(drafter: str, policy: Any) -> Callable[[], None]:
        def run() -> None:
            threads._GOVERNOR = policy
            for item in items:
                generate_json(handle, item["schema"], item["prompt"], drafter=drafter, max_new_tokens=max_new_tokens)
        return run

    configs: dict[str, Callable[[], None]] = {
        "target-only, thread governor": ours("none", governor), "target-only, fixed threads": ours("none", fixed),
        "auto, thread governor": ours("auto", governor), "auto, fixed threads": ours("auto", fixed),
    }
    if llama_calls:
        def reference() -> None:
            for call in llama_calls:
                call()

        configs["llama.cpp grammar (reference)"] = reference
    rows = {name: NeighbourRow(name) for name in configs}
    saved = threads._GOVERNOR
    try:
        ours("none", fixed)()  # warm: first-call allocations, compiled constraints
        for neighbour, command in NEIGHBOURS.items():
            _time_beside(neighbour, command, configs, rows, governor, start_threads, progress)
    finally:
        threads._GOVERNOR = saved
        torch.set_num_threads(start_threads)
    return list(rows.values())


def _llama_calls(handle: Any, items: list[dict[str, Any]], max_new_tokens: int) -> list[Callable[[], str]]:
    """llama.cpp's grammar path on the model's GGUF file, one call per prompt; none where it cannot run here."""
    from ..api import encode_prompt, load_schema
    from .single import llama_cpp_rows

    rows = llama_cpp_rows(handle.gguf_file, max_new_tokens) if handle.gguf_file is not None else {}
    llama = rows.get("llama.cpp grammar (reference)")
    if llama is None:
        return []
    return [llama(load_schema(item["schema"]), item["prompt"], encode_prompt(handle, item["prompt"]), max_new_tokens)
            for item in items]


def _time_beside(neighbour: str, command: list[str] | None, configs: dict[str, Callable[[], None]],
                 rows: dict[str, NeighbourRow], governor: Any, start_threads: int,
                 progress: Callable[[str], None]) -> None:
    """Time every configuration with ``command`` running beside it (None: alone); the
    neighbour starts a second before the runs and is killed after them."""
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) if command else None
    try:
        if proc is not None:
            time.sleep(1.0)  # let it get going (a torch import takes about that)
        for name, run in configs.items():
            torch.set_num_threads(start_threads)
            governor.reset()
            if name.endswith("thread governor"):
                # Two samples an interval apart, as a process that has been running has
                # them: the run starts at the thread count the load calls for, not at
                # the most threads for its first interval.
                governor.update()
                time.sleep(governor.interval)
                governor.update()
            t0 = time.perf_counter()
            run()
            rows[name].seconds[neighbour] = time.perf_counter() - t0
            progress(f"{neighbour}: {name} {rows[name].seconds[neighbour]:.2f} s")
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
