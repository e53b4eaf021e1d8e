"""The thread governor: torch's thread count follows the cores other processes leave free, and
forwards keep their bits at any thread count (so the governor changes speed only)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from constrained_spec import config
from constrained_spec.errors import InvalidOptionError
from constrained_spec.models import threads
from constrained_spec.models.threads import ThreadGovernor, busy_seconds


class Clocks:
    """A machine whose other processes keep ``others`` cores busy and we keep ``ours`` busy."""

    def __init__(self) -> None:
        self.t = self.busy = self.own = 0.0
        self.others, self.ours = 0.0, 2.0

    def advance(self, seconds: float) -> None:
        self.t += seconds
        self.busy += (self.others + self.ours) * seconds
        self.own += self.ours * seconds


def test_the_governor_gives_torch_the_cores_the_others_leave_free():
    c, applied = Clocks(), []
    g = ThreadGovernor(2, interval=0.25, busy=lambda: c.busy, own=lambda: c.own, set_threads=applied.append,
                       clock=lambda: c.t, cpus={0, 1})
    assert g.update() == 2 and applied == []  # first sample: nothing to compare yet
    c.advance(0.3)
    assert g.update() == 2 and g.others == pytest.approx(0.0)
    c.others, c.ours = 1.0, 1.0  # a neighbour takes a core
    c.advance(0.1)
    assert g.update() == 2  # within the interval: no sample
    c.advance(0.2)
    assert g.update() == 1 and applied == [1] and g.others == pytest.approx(1.0)
    c.others = 0.5  # busy half the time: 1.5 free cores still give one thread
    c.advance(0.3)
    assert g.update() == 1
    c.others = 0.2
    c.advance(0.3)
    assert g.update() == 2 and applied == [1, 2]
    c.others = 5.0  # more load than cores: never below one thread
    c.advance(0.3)
    assert g.update() == 1
    c.others = 0.0
    c.advance(0.3)
    assert g.update() == 2
    c.others = 2.0  # a neighbour busy through an idle gap: the stale sample is only a baseline
    c.advance(5.0)
    assert g.update() == 2 and applied[-1] == 2
    c.advance(0.3)  # the neighbour still busy an interval later: seen
    assert g.update() == 1


def test_busy_seconds_reads_only_this_process_cores(tmp_path):
    stat = tmp_path / "stat"
    tick = os.sysconf("SC_CLK_TCK")
    stat.write_text("cpu  900 0 900 100 0 0 0 0 0 0\n"
                    "cpu0 100 10 50 900 5 3 2 0 0 0\n"
                    "cpu1 200 0 100 800 0 0 0 7 0 0\n"
                    "cpu2 4000 0 0 0 0 0 0 0 0 0\n"
                    "intr 12345\n")
    assert busy_seconds({0, 1}, str(stat)) == pytest.approx((100 + 10 + 50 + 3 + 2 + 200 + 100) / tick)
    assert busy_seconds({2}, str(stat)) == pytest.approx(4000 / tick)
    assert busy_seconds({0}, str(tmp_path / "missing")) is None


def test_the_thread_setting_comes_from_the_first_load_or_the_environment(monkeypatch):
    """``RuntimeConfig.threads`` as a load asks for it (``request_threads``) or, before any load,
    ``CONSTRAINED_SPEC_THREADS``; a bad value names the variable."""
    before = torch.get_num_threads()
    variable = config.variable("threads")
    monkeypatch.setattr(threads, "_ASKED", [])
    try:
        for value, kind in (("auto", ThreadGovernor), ("", ThreadGovernor), ("off", threads._Fixed)):
            monkeypatch.setattr(threads, "_GOVERNOR", None)
            monkeypatch.setenv(variable, value)
            assert isinstance(threads.thread_governor(), kind)
        monkeypatch.setattr(threads, "_GOVERNOR", None)
        monkeypatch.setenv(variable, "1")
        assert threads.thread_governor().update() == 1 and torch.get_num_threads() == 1
        monkeypatch.setattr(threads, "_GOVERNOR", None)
        threads.request_threads("auto")  # a load's config wins over the environment
        threads.request_threads("off")  # and the first load's over a later one's
        assert isinstance(threads.thread_governor(), ThreadGovernor) and not threads._ASKED
        for bad in ("0", "two", "-1"):
            monkeypatch.setattr(threads, "_GOVERNOR", None)
            monkeypatch.setenv(variable, bad)
            with pytest.raises(InvalidOptionError, match=f"got CONSTRAINED_SPEC_THREADS='{bad}'"):
                threads.thread_governor()
        with pytest.raises(InvalidOptionError, match="got threads=0"):
            threads.request_threads(0)
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) != 2 or busy_seconds({0}) is None,
                    reason="measured on a 2-core Linux machine")
def test_a_busy_neighbour_on_one_of_two_cores_leaves_one_thread():
    applied: list[int] = []
    g = ThreadGovernor(2, interval=0.2, set_threads=applied.append)
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and g.threads != 1:
            g.update()
            time.sleep(0.05)
    finally:
        spinner.kill()
        spinner.wait()
    assert g.threads == 1 and applied[-1] == 1 and g.others is not None and g.others > 0.6


@pytest.mark.slow
@torch.no_grad()
@pytest.mark.parametrize("prompt_linears", ["dense", "int8"])
def test_native_forwards_give_the_same_bits_at_any_thread_count(monkeypatch, prompt_linears):
    """What lets the governor change the count mid-request: the prompt pass (its prompt rows on
    the dense path, run at the governor's most threads whatever it chose, or on the int8 kernel),
    decode and verify passes give the same logits at one thread as at two. (Without
    ``at_dense_threads`` the 300-row prompt's logits differed here, on an Intel Xeon with AMX.)"""
    from constrained_spec.config import RuntimeConfig
    from constrained_spec.models import q4_vnni
    from constrained_spec.models.growing_cache import growing_cache
    from constrained_spec.models.int4 import MIN_DENSE_ROWS, Int4Linear, prompt_matmul_dtype
    from constrained_spec.models.loading import load_model

    if prompt_linears == "int8" and q4_vnni.kernel() == "torch":
        pytest.skip("no VNNI kernel here: int8 prompt rows need it")
    model = load_model(precision="native", config=RuntimeConfig(prompt_linears=prompt_linears)).model
    layers = [m for m in model.modules() if isinstance(m, Int4Linear)]
    assert layers and all(m.prompt_int8 is (prompt_linears == "int8") for m in layers)
    before = torch.get_num_threads()
    monkeypatch.setattr(threads, "_GOVERNOR", ThreadGovernor(max(2, before)))
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 49152, (1, 300), generator=g)
    assert prompt.shape[1] - 1 >= MIN_DENSE_ROWS[prompt_matmul_dtype()]  # the dense path is taken where asked
    steps = [torch.randint(100, 49152, (1, k), generator=g) for k in (1, 4, 13)]

    def run(n: int) -> list[torch.Tensor]:
        torch.set_num_threads(n)
        cache = growing_cache(model.config.num_hidden_layers, torch.float64)
        out = [model(input_ids=prompt, cache=cache, use_cache=True, prompt_rows=prompt.shape[1] - 1).logits]
        assert torch.get_num_threads() == n  # the dense matmuls gave the governor's count back
        return out + [model(input_ids=s, cache=cache, use_cache=True, prompt_rows=0).logits for s in steps]

    try:
        many, one = run(max(2, before)), run(1)
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(many, one))


def test_loading_a_model_takes_the_governors_first_sample(monkeypatch):
    """``warm_up`` (the end of every load) samples the load, so the first request's first update
    measures an interval instead of running its first one at the most threads."""
    from constrained_spec import load_model
    from constrained_spec.models.loading import warm_up

    handle = load_model(precision="native")
    samples: list[float] = []
    governor = ThreadGovernor(2, busy=lambda: samples.append(1.0) or 10.0, own=lambda: 1.0, set_threads=lambda n: None)
    monkeypatch.setattr(threads, "_GOVERNOR", governor)
    warm_up(handle)
    assert samples == [1.0] and governor._last is not None
