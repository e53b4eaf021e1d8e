"""The project's own CPU kernels: their operator schemas and their build, once per machine.

Why hand-written kernels at all: batch invariance needs every row of a forward computed by the
same instructions in the same order whatever rows share the forward, and no CPU library kernel
for these ops promises that at speed (``models.q4_vnni``, ``models.attention_kernel`` say why for
each). They are C++ files beside this package (``kernels/``), built by
``torch.utils.cpp_extension`` into the cache on first use (about 8 s each with g++, then a load
in milliseconds) and registered as ``torch.ops.constrained_spec.*``, so TorchScript's layer loop
(``models.native_decode``) calls them directly. They are compiled with OpenMP: ``at::parallel_for``
is a header template that runs its body on one thread in a file built without it.

A machine without the instruction sets, a compiler or ninja keeps torch's ops; ``build`` says why
in a warning when the caller asks it to.
"""

from __future__ import annotations

import functools
import hashlib
import os
import warnings
from pathlib import Path

import torch

from ..storage import cache_dir

KERNELS = Path(__file__).parent / "kernels"
#: AVX-512 foundation, the byte/word, vector-length and dword subsets every kernel here uses.
AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512dq")
_BASE_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-fopenmp"]

# The operators' schemas, defined at import whether or not a kernel builds: TorchScript resolves
# an op by its schema when it compiles the layer loop, and takes that branch only where the
# kernel is loaded.
_LIBRARY = torch.library.Library("constrained_spec", "DEF")
_LIBRARY.define("q4_1_mm(Tensor x, Tensor packed, Tensor scales, bool split) -> Tensor")
_LIBRARY.define("q8_0_mm(Tensor x, Tensor packed, Tensor scales) -> Tensor")
_LIBRARY.define("attend_rows(Tensor query, Tensor key, Tensor value, Tensor? allowed, float scale) -> Tensor")
_LIBRARY.define("row_variance(Tensor x) -> Tensor")
_LIBRARY.define("add_rms_norm(Tensor x, Tensor? delta, Tensor weight, float eps) -> (Tensor, Tensor)")
_LIBRARY.define("rope_store(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) keys, Tensor(b!) values, int past, "
                "int q_heads, int head_dim) -> Tensor")


def switched_on(env: str) -> bool:
    """Whether the on/off variable ``env`` leaves its kernel on (``on``, the default, or ``off``);
    another value is refused with the ones it takes."""
    value = os.environ.get(env, "").strip().lower()
    if value not in ("", "on", "off"):
        raise ValueError(f"Invalid {env}={value!r}: use 'on' (the default) or 'off'.")
    return value != "off"


def cpu_flags() -> set[str]:
    """This CPU's feature flags (empty where ``/proc/cpuinfo`` cannot be read)."""
    from .int4 import _cpu_flags  # here, not at the top: int4 imports the kernels' modules

    return set(_cpu_flags())


def build(source: str, needs: tuple[str, ...], extra_flags: tuple[str, ...] = (), warn: bool = True) -> bool:
    """Build (once per machine, source and flags) and load ``kernels/<source>``; False where this
    CPU lacks a flag of ``needs`` or the build fails (with a warning naming why when ``warn``)."""
    why = _build(source, needs, extra_flags)
    if why and warn:
        warnings.warn(f"The {Path(source).stem} kernel {why}: torch's op runs instead.", stacklevel=3)
    return not why


@functools.lru_cache(maxsize=None)
def _build(source: str, needs: tuple[str, ...], extra_flags: tuple[str, ...]) -> str:
    """``build``'s work, once a process: "" once loaded, else why not."""
    path = KERNELS / source
    missing = [f for f in needs if f not in cpu_flags()]
    if missing:
        return f"needs {', '.join(missing)}, which this CPU lacks"
    from torch.utils import cpp_extension

    flags = _BASE_FLAGS + list(extra_flags)
    tag = hashlib.sha256(path.read_bytes() + " ".join(flags).encode() + torch.__version__.encode()).hexdigest()[:12]
    directory = cache_dir() / "kernels" / f"{path.stem}-{tag}"
    directory.mkdir(parents=True, exist_ok=True)
    try:
        cpp_extension.load(f"constrained_spec_{path.stem}_{tag}", [str(path)], extra_cflags=flags,
                           extra_ldflags=["-fopenmp"], build_directory=str(directory), is_python_module=False,
                           verbose=False)
    except (OSError, RuntimeError, ImportError) as error:
        return f"did not build ({str(error).splitlines()[0][:200]})"
    return ""
