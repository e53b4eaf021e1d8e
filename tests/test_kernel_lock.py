"""The CPU kernels' build and load cannot hang (``models.cpu_kernels``), tested with real
processes killed with SIGKILL: a builder killed mid-build leaves a lock the next builder takes
over; a process killed while loading leaves nothing; a live holder makes a builder give up after
its bound with a warning; torch's lock file from the earlier scheme is ignored.

One real build for the module (the layer ops, the quickest kernel), shared by the tests through
``killed_build``; each test runs in its own cache (``$CONSTRAINED_SPEC_CACHE``)."""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from constrained_spec.models import cpu_kernels
from constrained_spec.storage import CACHE_ENV

SOURCE, FLAGS = "layer_ops.cpp", ("-ffp-contract=off",)
# The child's build call, its result and its duration on stdout; log lines (the stale lock) on stderr.
BUILD = f"""
import logging, time
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
from constrained_spec.models import cpu_kernels
start = time.monotonic()
ok = cpu_kernels.build({SOURCE!r}, cpu_kernels.AVX512, {FLAGS!r})
print("RESULT", ok, time.monotonic() - start, flush=True)
"""
# A loader that stops inside ``torch.ops.load_library`` until it is killed there.
STUCK_IN_LOAD = """
import time, torch
def stuck(path):
    print("LOADING", path, flush=True)
    time.sleep(600)
torch.ops.load_library = stuck
from constrained_spec.models import cpu_kernels
cpu_kernels.build({source!r}, cpu_kernels.AVX512, {flags!r})
""".format(source=SOURCE, flags=FLAGS)


def _needs_avx512() -> None:
    if not set(cpu_kernels.AVX512) <= cpu_kernels.cpu_flags():
        pytest.skip("this CPU lacks AVX-512, so no kernel builds or takes a lock")


def _needs_toolchain() -> None:
    from torch.utils import cpp_extension

    _needs_avx512()
    if shutil.which(cpp_extension.get_cxx_compiler()) is None or not cpp_extension.is_ninja_available():
        pytest.skip("no C++ compiler or no ninja: the kernels do not build here")


def _paths(cache: Path) -> tuple[Path, Path, Path]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_ENV, str(cache))
        return cpu_kernels.kernel_paths(SOURCE, FLAGS)


def _run(script: str, env: dict[str, str], timeout: float) -> tuple[bool, float, str]:
    """Run ``script`` in a new interpreter: the build's result, its seconds, the child's stderr."""
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
    found = re.search(r"^RESULT (True|False) ([\d.]+)$", done.stdout, re.M)
    assert found, (done.returncode, done.stdout, done.stderr)
    return found[1] == "True", float(found[2]), done.stderr


def _wait_for(condition, child: subprocess.Popen, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if child.poll() is not None:
            raise AssertionError(f"the child ended before {what}: {child.communicate()}")
        assert time.monotonic() < deadline, f"the child did not reach {what} in {timeout:g} s"
        time.sleep(0.05)


@dataclass
class KilledBuild:
    cache: Path
    env: dict[str, str]
    directory: Path
    library: Path
    lock: Path
    killed_pid: int
    left_behind: list[Path]  # the killed builder's private folders, seen after the kill
    ok: bool
    seconds: float
    log: str


@pytest.fixture(scope="module")
def killed_build(tmp_path_factory) -> KilledBuild:
    """A builder SIGKILLed mid-build (the compiler running), then a second builder on the same
    cache; the folder also holds an empty ``lock`` as torch's scheme left it."""
    _needs_toolchain()
    cache = tmp_path_factory.mktemp("kernel-cache")
    env = {**os.environ, CACHE_ENV: str(cache)}
    directory, library, lock = _paths(cache)
    directory.mkdir(parents=True)
    (directory / "lock").touch()  # torch's FileBaton from the earlier scheme, left by a killed load
    # Its own session, so the compilers it started can be ended by its group id afterwards.
    first = subprocess.Popen([sys.executable, "-c", BUILD], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        holds = lambda: lock.is_file() and lock.read_text().strip() == str(first.pid)  # noqa: E731
        compiling = lambda: any(directory.glob("build-*/build.ninja"))  # noqa: E731
        _wait_for(lambda: holds() and compiling(), first, "its build")
        first.send_signal(signal.SIGKILL)  # the Python process alone, as the OOM killer does
        first.wait(timeout=30)
        left_behind = sorted(directory.glob("build-*"))
        ok, seconds, log = _run(BUILD, env, timeout=180)
    finally:
        try:
            os.killpg(first.pid, signal.SIGKILL)  # the orphaned compilers of the killed builder
        except ProcessLookupError:
            pass
        first.communicate(timeout=30)
    return KilledBuild(cache, env, directory, library, lock, first.pid, left_behind, ok, seconds, log)


def test_a_builder_killed_mid_build_leaves_a_lock_the_next_takes_over(killed_build):
    k = killed_build
    assert k.left_behind, "the kill came after the build, not during it"
    assert k.ok and k.library.is_file()
    assert "took over a stale build lock" in k.log and str(k.lock) in k.log and str(k.killed_pid) in k.log
    assert not list(k.directory.glob("build-*")), "the killed builder's folder was not swept"
    assert k.lock.read_text() == "", "a clean release empties the lock"


def test_a_process_killed_while_loading_leaves_nothing_to_wait_on(killed_build):
    k = killed_build
    assert k.library.is_file()
    built_at = k.library.stat().st_mtime_ns
    loader = subprocess.Popen([sys.executable, "-c", STUCK_IN_LOAD], env=k.env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        line = loader.stdout.readline()
        assert line.startswith("LOADING") and str(k.library) in line, (line, loader.stderr.read())
        loader.send_signal(signal.SIGKILL)
    finally:
        loader.kill()  # no-op once dead; ends it should the assertion above fail
        loader.communicate(timeout=30)
    assert str(loader.pid) not in k.lock.read_text(), "the load path took the build lock"
    ok, seconds, log = _run(BUILD, k.env, timeout=60)
    assert ok and seconds < 5, (seconds, log)
    assert "stale" not in log
    assert k.library.stat().st_mtime_ns == built_at, "a load rebuilt the kernel"


def test_torch_s_old_lock_file_blocks_no_load(killed_build):
    k = killed_build
    assert (k.directory / "lock").is_file(), "the fixture's old lock is gone: nothing tested"
    ok, seconds, log = _run(BUILD, k.env, timeout=60)
    assert ok and seconds < 5, (seconds, log)


def test_a_live_holder_makes_a_builder_give_up_after_its_bound(tmp_path, monkeypatch):
    _needs_avx512()
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    directory, library, lock = cpu_kernels.kernel_paths(SOURCE, FLAGS)
    directory.mkdir(parents=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # this process, alive, holds the build lock
        os.write(fd, f"{os.getpid()}\n".encode())
        start = time.monotonic()
        # warn=False as the layer kernels pass it: giving up after a wait warns whatever the caller asked.
        # A bound no other test passes, so ``_build``'s per-process cache holds no answer for it.
        with pytest.warns(UserWarning, match=re.escape(str(lock))) as caught:
            assert not cpu_kernels.build(SOURCE, cpu_kernels.AVX512, FLAGS, warn=False, lock_timeout=1.0)
        waited = time.monotonic() - start
        assert str(os.getpid()) in str(caught[0].message)
        assert lock.read_text().strip() == str(os.getpid()), "the builder wrote into a held lock"
        assert 1.0 <= waited < 10, waited
        assert not library.exists() and not list(directory.glob("build-*"))
    finally:
        os.close(fd)


def test_a_kernel_asking_for_no_instruction_set_still_needs_what_the_build_flags_compile_for(monkeypatch):
    """Every kernel is compiled with the AVX-512 base flags, so one that names no instruction set
    of its own (dense_blocks) must not be built and loaded on a CPU without them: it stopped the
    process with an illegal instruction there. Nothing is compiled here: the refusal comes first."""
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: {"avx2", "fma"})
    why, _ = cpu_kernels._build.__wrapped__("dense_blocks.cpp", (), (), 1.0)
    assert why.startswith("needs avx512f"), why
