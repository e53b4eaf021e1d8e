"""The project's own CPU kernels: their operator schemas and their build, once per machine.

Why hand-written kernels at all: batch invariance needs every row of a forward computed by the
same instructions in the same order whatever rows share the forward, and no CPU library kernel
for these ops promises that at speed (``models.q4_vnni``, ``models.attention_kernel`` say why for
each). They are C++ files beside this package (``kernels/``), built by
``torch.utils.cpp_extension`` into the cache on first use and registered as
``torch.ops.constrained_spec.*``, so TorchScript's layer loop (``models.native_decode``) calls
them directly. They are compiled with OpenMP: ``at::parallel_for`` is a header template that runs
its body on one thread in a file built without it.

Why ``cpp_extension.load`` never runs in the cache folder itself: it takes a lock file in its
build folder on every load, and a process killed while holding it (Ctrl-C during the first load,
the OOM killer) leaves every later load on the machine waiting forever. So a built library loads
with no lock at all; a build holds an ``flock`` (which the system drops when its holder dies) with the holder's
id in it, so the next builder takes a stale lock over and says so in a log line; it compiles in a
private folder and moves the library into place in one rename; and a builder that waits
``BUILD_LOCK_TIMEOUT_S`` on a live holder gives up with a warning and keeps torch's ops.

A machine without the instruction sets, a compiler or ninja keeps torch's ops; ``build`` says why
in a warning when the caller asks it to.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Callable

import torch

from .. import config
from ..storage import cache_dir

KERNELS = Path(__file__).parent / "kernels"
#: AVX-512 foundation, the byte/word, vector-length and dword subsets every kernel here uses.
AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512dq")
_BASE_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-fopenmp"]
#: The CPU flags ``_BASE_FLAGS`` compile for, which every kernel needs whatever it uses.
BASE_NEEDS = (*AVX512, "fma")
#: Seconds a builder waits for another live process's build of the same kernel before it gives up
#: and keeps torch's ops: a few times a build's length on a busy machine.
BUILD_LOCK_TIMEOUT_S = 120.0
_LOCK_POLL_S = 0.1
_BUILD_PREFIX = "build-"  # private build folders inside a kernel's cache folder

_log = logging.getLogger(__name__)

# The operators' schemas, defined at import whether or not a kernel builds: TorchScript resolves
# an op by its schema when it compiles the layer loop, and takes that branch only where the
# kernel is loaded.
_LIBRARY = torch.library.Library("constrained_spec", "DEF")
_LIBRARY.define("q4_1_mm(Tensor x, Tensor packed, Tensor scales, bool split) -> Tensor")
_LIBRARY.define("q8_0_mm(Tensor x, Tensor packed, Tensor scales) -> Tensor")
_LIBRARY.define("attend_rows(Tensor query, Tensor key, Tensor value, Tensor? allowed, float scale) -> Tensor")
_LIBRARY.define("prompt_attend(Tensor query, Tensor key, Tensor value, int first, float scale, int window=0) -> Tensor")
_LIBRARY.define("row_variance(Tensor x) -> Tensor")
_LIBRARY.define("linear_blocks(Tensor x, Tensor[] blocks, int[] widths, ScalarType? dtype=None) -> Tensor")
_LIBRARY.define("add_rms_norm(Tensor x, Tensor? delta, Tensor weight, float eps) -> (Tensor, Tensor)")
_LIBRARY.define("rope_store(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) keys, Tensor(b!) values, int past, "
                "int q_heads, int head_dim) -> Tensor")


class ProcessChoice:
    """Whether this process runs one kernel: asked for by the first load's ``RuntimeConfig``
    (``request``; before any load, by the environment through ``config.read``), then fixed at
    the first call with whether it builds, so a model's forwards never mix two paths."""

    def __init__(self, setting: str, build: Callable[[], bool]) -> None:
        self.setting = setting  # the RuntimeConfig field that asks for it
        self._build = build
        self._asked: bool | None = None
        self._chosen: bool | None = None
        self._lock = threading.Lock()

    def request(self, switched_on: bool) -> None:
        """Ask for the kernel on or off; a no-op once the choice is made or asked for."""
        with self._lock:
            if self._asked is None:
                self._asked = switched_on

    def __call__(self) -> bool:
        """Whether this process runs the kernel (made on the first call: asked for and built)."""
        if self._chosen is None:
            with self._lock:
                if self._chosen is None:
                    asked = self._asked if self._asked is not None else config.read(self.setting)
                    self._chosen = bool(asked) and self._build()
        return self._chosen


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (empty where ``/proc/cpuinfo`` cannot be read), read once."""
    try:
        return frozenset(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return frozenset()


def build(source: str, needs: tuple[str, ...], extra_flags: tuple[str, ...] = (), warn: bool = True, *,
          lock_timeout: float = BUILD_LOCK_TIMEOUT_S) -> bool:
    """Build (once per machine, source and flags) and load ``kernels/<source>``; False where this
    CPU lacks a flag of ``needs``, the build fails (with a warning naming why when ``warn``) or
    another live process kept the build lock for ``lock_timeout`` seconds (always with a warning:
    the caller waited, then runs slower ops)."""
    why, loud = _build(source, needs, extra_flags, lock_timeout)
    if why and (warn or loud):
        warnings.warn(f"The {Path(source).stem} kernel {why}: torch's op runs instead.", stacklevel=3)
    return not why


def kernel_paths(source: str, extra_flags: tuple[str, ...] = ()) -> tuple[Path, Path, Path]:
    """Where ``kernels/<source>`` built with ``extra_flags`` lives in the cache: its folder, its
    library and its build lock. The folder's name changes with the source, the headers it may
    include (``kernels/*.h``), the flags and torch."""
    path = KERNELS / source
    flags = _BASE_FLAGS + list(extra_flags)
    headers = b"".join(h.read_bytes() for h in sorted(KERNELS.glob("*.h")))
    tag = hashlib.sha256(path.read_bytes() + headers + " ".join(flags).encode()
                         + torch.__version__.encode()).hexdigest()[:12]
    directory = cache_dir() / "kernels" / f"{path.stem}-{tag}"
    # The name torch's builder gives the library, so a cache filled by an earlier version loads as is.
    return directory, directory / f"constrained_spec_{path.stem}_{tag}.so", directory / "build.lock"


@functools.lru_cache(maxsize=None)
def _build(source: str, needs: tuple[str, ...], extra_flags: tuple[str, ...],
           lock_timeout: float) -> tuple[str, bool]:
    """``build``'s work, once a process: ("", False) once loaded, else why not and whether to
    warn whatever the caller asked."""
    # Every kernel is compiled with the AVX-512 base flags, so the compiler may vectorize any
    # loop with them: a kernel that asks for no instruction set of its own still needs these
    # (dense_blocks stopped a CPU without them with an illegal instruction at load).
    missing = [f for f in dict.fromkeys((*BASE_NEEDS, *needs)) if f not in cpu_flags()]
    if missing:
        return f"needs {', '.join(missing)}, which this CPU lacks", False
    directory, library, lock = kernel_paths(source, extra_flags)
    try:
        if _load_built(library):
            return "", False
        directory.mkdir(parents=True, exist_ok=True)
        held = _acquire(lock, lock_timeout)
        if held is None:
            holder = lock.read_text(errors="replace").strip() or "?"
            return (f"was not built: process {holder}, still running, held its build lock {lock} "
                    f"for the {lock_timeout:g} s this one waited"), True
        try:
            if _load_built(library):  # the process this one waited for built it
                return "", False
            _build_locked(source, extra_flags, directory, library)
        finally:
            _release(held)
    except (OSError, RuntimeError, ImportError) as error:
        return f"did not build ({str(error).splitlines()[0][:200]})", False
    return "", False


def _load_built(library: Path) -> bool:
    """Load ``library`` if it is there, taking no lock; False where it is absent or cannot be
    opened (a truncated file from an interrupted build of an earlier version: rebuilt)."""
    if not library.is_file():
        return False
    try:
        torch.ops.load_library(str(library))
    except OSError:
        return False
    return True


def _build_locked(source: str, extra_flags: tuple[str, ...], directory: Path, library: Path) -> None:
    """Compile ``kernels/<source>`` in a private folder under ``directory`` and move the library
    to ``library`` in one step, so no reader ever opens a half-written file. The caller holds the
    build lock."""
    from torch.utils import cpp_extension

    for left in directory.glob(f"{_BUILD_PREFIX}*"):  # folders of builders killed mid-build
        shutil.rmtree(left, ignore_errors=True)
    build_dir = tempfile.mkdtemp(prefix=_BUILD_PREFIX, dir=directory)
    try:
        # torch's own lock lives in this fresh folder, which no other process ever enters.
        built = cpp_extension.load(library.stem, [str(KERNELS / source)], extra_cflags=_BASE_FLAGS + list(extra_flags),
                                   extra_ldflags=["-fopenmp"], build_directory=build_dir, is_python_module=False,
                                   verbose=False)
        os.replace(built, library)  # torch has loaded it already; a rename keeps the mapped file
    finally:
        shutil.rmtree(build_dir, ignore_errors=True)


def _acquire(lock: Path, timeout: float) -> int | None:
    """Take the build lock ``lock`` (an ``flock``, which the system drops when its holder dies,
    however it dies) and write this process's id into it; None after ``timeout`` seconds."""
    import fcntl  # here, not at the top: a system without it never reaches a build (no /proc/cpuinfo)

    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    return None
                time.sleep(_LOCK_POLL_S)
        left = os.pread(fd, 32, 0).decode(errors="replace").strip()
        if left:  # a clean release empties the file, so an id left here is a holder that died holding it
            _log.warning("took over a stale build lock %s left by process %s, which ended while building", lock, left)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except BaseException:
        os.close(fd)  # a long-lived process must not keep the lock after a failed write
        raise
    return fd


def _release(fd: int) -> None:
    """Empty the build lock (no stale id for the next holder to report) and release it."""
    try:
        os.ftruncate(fd, 0)
    finally:
        os.close(fd)  # closing drops the flock
