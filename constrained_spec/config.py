"""The runtime configuration: every ``CONSTRAINED_SPEC_*`` setting of the library, declared,
read and checked here and nowhere else.

``RuntimeConfig.from_env()`` reads them all at once; ``load_model`` does so once per load (or
takes ``config=``) and hands each setting to what needs it. Each variable is declared once in
``SETTINGS`` with its values, default and meaning; docs/configuration.md is their table.

A bad value raises ``RuntimeConfigError``: "Invalid <setting>: expected <the values it takes>,
got <VARIABLE>=<value>." It is a ``ModelLoadError`` (what ``load_model`` raises), an
``InvalidOptionError`` and so a ``ValueError``: code that caught any of those for a bad variable
still does.

The command line's client variables, the benchmarks' data folder and the test suite's fuzz count
are read where they are used; ``CLIENT_VARIABLES`` lists them for the docs.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, Literal, Mapping

from .errors import InvalidOptionError, ModelLoadError

Int4Kernel = Literal["torch", "vnni", "vnni-int8"]
OutputKernel = Literal["vnni", "torch"]

#: ``CONSTRAINED_SPEC_INT4_KERNEL``'s values (``models.q4_vnni``) and its default.
INT4_KERNELS: tuple[str, ...] = ("torch", "vnni", "vnni-int8")
DEFAULT_INT4_KERNEL = "vnni"
#: ``CONSTRAINED_SPEC_OUTPUT_KERNEL``'s values (``models.q8_output``); unset: "vnni" where it builds.
OUTPUT_KERNELS: tuple[str, ...] = ("vnni", "torch")
#: The compiled-constraint cache's bound when ``CONSTRAINED_SPEC_CONSTRAINT_CACHE_MB`` is unset.
DEFAULT_CONSTRAINT_CACHE_MB = 256.0
#: MiB of freed memory the allocator keeps when ``CONSTRAINED_SPEC_HEAP_KEEP_MB`` is unset (``models.heap``).
DEFAULT_HEAP_KEEP_MB = 256
#: ``CONSTRAINED_SPEC_CUDA_GRAPHS``'s spellings of on and off (any case; unset or empty: on).
CUDA_GRAPHS_ON = ("on", "1", "true", "yes")
CUDA_GRAPHS_OFF = ("off", "0", "false", "no")


class RuntimeConfigError(ModelLoadError, InvalidOptionError):
    """A ``CONSTRAINED_SPEC_*`` variable or a ``RuntimeConfig`` field with a value it does not
    take; the message names it, the value and the values it takes."""


class _Refused(Exception):
    """A parser's refusal; its text is what the setting takes."""


def _quoted(values: tuple[str, ...]) -> str:
    return ", ".join(map(repr, values))


def _choice(raw: str | None, values: tuple[str, ...], default: str) -> str | None:
    """One of ``values`` (trimmed, any case), or None when unset or empty (the default)."""
    value = (raw or "").strip().lower()
    if value and value not in values:
        raise _Refused(f"one of {_quoted(values)} (default {default})")
    return value or None


def _int4_kernel(raw: str | None) -> str | None:
    return _choice(raw, INT4_KERNELS, repr(DEFAULT_INT4_KERNEL))


def _output_kernel(raw: str | None) -> str | None:
    return _choice(raw, OUTPUT_KERNELS, "'vnni' where it builds")


def _switch(raw: str | None) -> bool:
    """An on/off kernel switch: 'on' (the default) or 'off', trimmed, any case."""
    return _choice(raw, ("on", "off"), "'on'") != "off"


#: How the native model's prompt rows attend: "auto" in bfloat16 where AMX multiplies it.
PROMPT_ATTENTION = ("auto", "float32", "bfloat16")


def _prompt_attention(raw: str | None) -> str:
    return _choice(raw, PROMPT_ATTENTION, "'auto'") or "auto"


#: What the native model's prompt rows are multiplied on (``models.int4``): "auto" is "dense".
PROMPT_LINEARS = ("auto", "int8", "dense")


def _prompt_linears(raw: str | None) -> str:
    return _choice(raw, PROMPT_LINEARS, "'auto'") or "auto"


#: What a native model's KV cache holds.
KV_CACHE = ("float32", "bfloat16")


def _kv_cache(raw: str | None) -> str:
    return _choice(raw, KV_CACHE, "'float32'") or "float32"


def _cuda_graphs(raw: str | None) -> bool:
    value = (raw or "").strip().lower()
    if value and value not in CUDA_GRAPHS_ON + CUDA_GRAPHS_OFF:
        raise _Refused(f"one of {_quoted(CUDA_GRAPHS_ON + CUDA_GRAPHS_OFF)} (default 'on')")
    return value not in CUDA_GRAPHS_OFF


def _threads(raw: str | None) -> str | int:
    value = (raw or "").strip().lower()
    if value in ("auto", "off"):
        return value
    if not value:
        return "auto"
    if value.isdigit() and int(value) > 0:
        return int(value)
    raise _Refused("'auto' (the default), 'off' or a positive thread count")


def _cache_dir(raw: str | None) -> Path | None:
    return Path(raw) if raw else None


def _constraint_cache_mb(raw: str | None) -> float:
    if raw is None:
        return DEFAULT_CONSTRAINT_CACHE_MB
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (math.isfinite(value) and value >= 0):
        raise _Refused("a number of MiB >= 0 (default 256)")
    return value


def _heap_keep_mb(raw: str | None) -> int:
    if raw is None or not raw.strip():
        return DEFAULT_HEAP_KEEP_MB
    value = raw.strip()
    if not value.isdigit():
        raise _Refused(f"a whole number of MiB >= 0 (default {DEFAULT_HEAP_KEEP_MB})")
    return int(value)


#: The hardware profiles ``decoding.profiles`` holds a K_max table for (it checks it holds these).
HARDWARE_PROFILES: tuple[str, ...] = ("a100-80gb", "cpu", "gb200-nvl72", "h100-80gb", "h100-80gb-x8")


def _profile(raw: str | None) -> str | None:
    if raw and raw not in HARDWARE_PROFILES:
        raise _Refused(f"one of {_quoted(HARDWARE_PROFILES)} (default: detected from the device)")
    return raw or None


@dataclass(frozen=True)
class Setting:
    """One environment variable: the ``RuntimeConfig`` field it fills, its name in messages,
    its parser (text or None when unset -> the field's value) and its row of the docs' table."""

    field: str
    variable: str
    label: str
    parse: Callable[[str | None], Any]
    values: str
    default: str
    what: str


#: Every variable ``RuntimeConfig.from_env`` reads, in the docs' order.
SETTINGS: tuple[Setting, ...] = (
    Setting("int4_kernel", "CONSTRAINED_SPEC_INT4_KERNEL", "int4 kernel", _int4_kernel,
            "`vnni`, `vnni-int8`, `torch`", "`vnni` where it builds, else `torch`",
            "The kernel of the native model's Q4_1 linear layers (`models.q4_vnni`): `vnni` splits each "
            "activation into two int8 parts, `vnni-int8` rounds it to one as llama.cpp does, `torch` is "
            "torch's int4 kernel. Named and unable to build, it warns and runs `torch`."),
    Setting("output_kernel", "CONSTRAINED_SPEC_OUTPUT_KERNEL", "output kernel", _output_kernel,
            "`vnni`, `torch`", "`vnni` where it builds, else `torch`",
            "The kernel of the native model's Q8_0 output projection (`models.q8_output`); `torch` runs it "
            "as two int4 matrices. Named and unable to build, it warns."),
    Setting("attention_kernel", "CONSTRAINED_SPEC_ATTENTION_KERNEL", "attention kernel switch", _switch,
            "`on`, `off`", "`on`",
            "Batch-invariant attention of new rows on the CPU kernel (`models.attention_kernel`) where it "
            "builds; `off` computes it in float64. One choice per process: the first load's."),
    Setting("layer_kernels", "CONSTRAINED_SPEC_LAYER_KERNELS", "layer kernels switch", _switch,
            "`on`, `off`", "`on`",
            "The norms, rotary embedding and cache writes of batch-invariant layers on the CPU kernels "
            "(`models.layer_kernels`) where they build; `off` runs torch's ops. One choice per process: the "
            "first load's."),
    Setting("prompt_attention", "CONSTRAINED_SPEC_PROMPT_ATTENTION", "prompt attention", _prompt_attention,
            "`auto`, `float32`, `bfloat16`", "`auto`",
            "How the native model's prompt rows attend: `auto` in bfloat16 where AMX multiplies it, else in "
            "float32; `float32` or `bfloat16` always (docs/extraction.md has what each costs and changes). "
            "Read at each load."),
    Setting("prompt_linears", "CONSTRAINED_SPEC_PROMPT_LINEARS", "prompt linears", _prompt_linears,
            "`auto`, `int8`, `dense`", "`auto`",
            "What the native model's prompt rows are multiplied on: `auto` and `dense` on a bfloat16 (or "
            "float32) copy of the weights, `int8` on the VNNI kernel with each activation rounded to int8 as "
            "llama.cpp does: faster without AMX and no second copy, further from the float32 model's outputs "
            "(docs/extraction.md has what each costs and changes). Read at each load."),
    Setting("kv_cache", "CONSTRAINED_SPEC_KV_CACHE", "KV cache", _kv_cache, "`float32`, `bfloat16`", "`float32`",
            "What a native model's KV cache holds where the attention kernels read it: `bfloat16` takes half "
            "the memory and half the bytes a decode step over a long document reads, and moves the outputs "
            "further from the float32 model's (docs/extraction.md has what each costs and changes). Read at "
            "each load."),
    Setting("cuda_graphs", "CONSTRAINED_SPEC_CUDA_GRAPHS", "CUDA graphs switch", _cuda_graphs,
            "`on`, `1`, `true`, `yes`, `off`, `0`, `false`, `no` (any case)", "`on`",
            "A batch-invariant model on a GPU replays its decode and verify forwards as CUDA graphs "
            "(`models.cuda_graphs`); off keeps them eager. Read at each load."),
    Setting("threads", "CONSTRAINED_SPEC_THREADS", "thread count", _threads,
            "`auto`, `off`, a positive integer", "`auto`",
            "torch's thread count: `auto` follows the cores other processes leave free (`models.threads`), "
            "a number fixes it, `off` leaves torch's setting alone. One choice per process: the first load's."),
    Setting("heap_keep_mb", "CONSTRAINED_SPEC_HEAP_KEEP_MB", "heap keep size", _heap_keep_mb,
            "a whole number of MiB >= 0", f"`{DEFAULT_HEAP_KEEP_MB}`",
            "How much freed memory glibc's allocator keeps for reuse (`models.heap`): a long prompt's large "
            "tensors then reuse the last ones' pages rather than fault in fresh ones (docs/extraction.md); "
            "`0` leaves the allocator's settings alone. One choice per process: the first load's."),
    Setting("cache_dir", "CONSTRAINED_SPEC_CACHE", "cache folder", _cache_dir,
            "a folder", "`$XDG_CACHE_HOME/constrained_spec` (`~/.cache/constrained_spec`)",
            "Where converted weights, packed kernels' weights and built kernels are kept between runs; "
            "nothing there is needed for correctness."),
    Setting("constraint_cache_mb", "CONSTRAINED_SPEC_CONSTRAINT_CACHE_MB", "constraint cache size",
            _constraint_cache_mb, "a number of MiB >= 0", "`256`",
            "The bound of the compiled-constraint cache, least recently used dropped first (`0` keeps "
            "only the latest)."),
    Setting("profile", "CONSTRAINED_SPEC_PROFILE", "profile", _profile,
            "`cpu`, `a100-80gb`, `h100-80gb`, `h100-80gb-x8`, `gb200-nvl72`", "detected from the device",
            "The hardware profile that sets K_max (`decoding.profiles`) for requests that name none."),
)

#: Variables read where they are used, outside ``RuntimeConfig``: (name, values, default, what).
CLIENT_VARIABLES: tuple[tuple[str, str, str, str], ...] = (
    ("CONSTRAINED_SPEC_SERVER", "a URL", "unset: decode in this process",
     "The command line sends its requests to a running `constrained-spec serve` at this URL "
     "(as `--server`)."),
    ("CONSTRAINED_SPEC_API_KEY", "a string", "unset: no key",
     "`constrained-spec serve` requires it as a bearer token (as `--api-key`); the command line's "
     "client sends it."),
    ("CONSTRAINED_SPEC_SCHEMA_DATA", "a folder", "`shared/data/jsonschemabench` beside the checkout",
     "Where `constrained-spec train-drafter` and the benchmarks find the JSONSchemaBench subsets."),
    ("CONSTRAINED_SPEC_FUZZ_EXAMPLES", "a positive integer", "`60`",
     "How many generated requests the test suite's fuzz test sends (`tests/test_fuzz.py`)."),
)

_BY_FIELD = {s.field: s for s in SETTINGS}


def variable(field: str) -> str:
    """The environment variable of a ``RuntimeConfig`` field."""
    return _BY_FIELD[field].variable


def read(field: str, environ: Mapping[str, str] = os.environ) -> Any:
    """One setting from ``environ``, parsed and checked as ``RuntimeConfig.from_env`` does. For
    what is read outside a load: the cache folder (tools point it elsewhere while a process runs)
    and a process-wide choice asked for before any load."""
    setting = _BY_FIELD[field]
    raw = environ.get(setting.variable)
    try:
        return setting.parse(raw)
    except _Refused as refused:
        message = f"Invalid {setting.label}: expected {refused}, got {setting.variable}={raw!r}."
        raise RuntimeConfigError(message) from None


def default_cache_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """The cache folder when ``CONSTRAINED_SPEC_CACHE`` is unset: ``$XDG_CACHE_HOME/constrained_spec``."""
    return Path(os.path.join(environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "constrained_spec"))


@dataclass(frozen=True)
class RuntimeConfig:
    """The library's runtime settings, one field per ``CONSTRAINED_SPEC_*`` variable (``SETTINGS``
    says each one's values and meaning).

    Build it with ``from_env()`` or directly (``RuntimeConfig(threads=1)``); either way each value
    is checked, and a bad one raises ``RuntimeConfigError``. None stands for a default that
    depends on the machine."""

    #: The native model's Q4_1 kernel; None: "vnni" where it builds, else "torch", silently.
    int4_kernel: Int4Kernel | None = None
    #: The native model's Q8_0 output kernel; None: "vnni" where it builds, else "torch", silently.
    output_kernel: OutputKernel | None = None
    attention_kernel: bool = True
    layer_kernels: bool = True
    #: "auto" (bfloat16 where AMX multiplies it), "float32" or "bfloat16".
    prompt_attention: str = "auto"
    #: "auto" (the same as "dense") or "int8".
    prompt_linears: str = "auto"
    #: "float32" or "bfloat16".
    kv_cache: str = "float32"
    cuda_graphs: bool = True
    #: "auto", "off" or a fixed thread count.
    threads: str | int = "auto"
    #: MiB of freed memory the allocator keeps; 0: its own settings.
    heap_keep_mb: int = DEFAULT_HEAP_KEEP_MB
    #: None: ``default_cache_dir()``.
    cache_dir: Path | None = None
    constraint_cache_mb: float = DEFAULT_CONSTRAINT_CACHE_MB
    #: None: detected from the device.
    profile: str | None = None

    def __post_init__(self) -> None:
        def check(name: str, ok: bool, expected: str) -> None:
            if not ok:
                raise RuntimeConfigError(f"Invalid {_BY_FIELD[name].label}: expected {expected}, "
                                         f"got {name}={getattr(self, name)!r}.")

        check("int4_kernel", self.int4_kernel is None or self.int4_kernel in INT4_KERNELS,
              f"None or one of {_quoted(INT4_KERNELS)}")
        check("output_kernel", self.output_kernel is None or self.output_kernel in OUTPUT_KERNELS,
              f"None or one of {_quoted(OUTPUT_KERNELS)}")
        for name in ("attention_kernel", "layer_kernels", "cuda_graphs"):
            check(name, isinstance(getattr(self, name), bool), "True or False")
        check("prompt_attention", self.prompt_attention in PROMPT_ATTENTION, f"one of {_quoted(PROMPT_ATTENTION)}")
        check("prompt_linears", self.prompt_linears in PROMPT_LINEARS, f"one of {_quoted(PROMPT_LINEARS)}")
        check("kv_cache", self.kv_cache in KV_CACHE, f"one of {_quoted(KV_CACHE)}")
        check("threads", self.threads in ("auto", "off") or (type(self.threads) is int and self.threads > 0),
              "'auto', 'off' or a positive thread count")
        check("heap_keep_mb", type(self.heap_keep_mb) is int and self.heap_keep_mb >= 0, "a whole number of MiB >= 0")
        check("cache_dir", self.cache_dir is None or isinstance(self.cache_dir, (str, os.PathLike)), "None or a folder")
        if self.cache_dir is not None:
            object.__setattr__(self, "cache_dir", Path(self.cache_dir))
        check("constraint_cache_mb", isinstance(self.constraint_cache_mb, (int, float))
              and not isinstance(self.constraint_cache_mb, bool) and math.isfinite(self.constraint_cache_mb)
              and self.constraint_cache_mb >= 0,
              "a number of MiB >= 0")
        check("profile", self.profile is None or (isinstance(self.profile, str) and _known_profile(self.profile)),
              "None or a known profile (decoding.profiles.K_MAX_PROFILES)")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "RuntimeConfig":
        """Every setting from ``environ``, each checked (the first bad one raises
        ``RuntimeConfigError``, naming it)."""
        return cls(**{s.field: read(s.field, environ) for s in SETTINGS})

    @property
    def cache_root(self) -> Path:
        """``cache_dir``, or ``default_cache_dir()`` when it is None."""
        return self.cache_dir if self.cache_dir is not None else default_cache_dir()

    @property
    def constraint_cache_bytes(self) -> int:
        """``constraint_cache_mb`` in bytes (what ``constraint.compile.set_cache_bytes`` takes)."""
        return int(self.constraint_cache_mb * (1 << 20))


def _known_profile(profile: str) -> bool:
    return profile in HARDWARE_PROFILES


assert {f.name for f in fields(RuntimeConfig)} == set(_BY_FIELD), "one Setting per RuntimeConfig field"


def docs_table() -> str:
    """The table of every variable in docs/configuration.md (a test keeps the page equal to it)."""
    rows = [(f"`{s.variable}`", s.values, s.default, s.what) for s in SETTINGS]
    rows += [(f"`{name}`", values, default, what) for name, values, default, what in CLIENT_VARIABLES]
    lines = ["| Variable | Values | Default | What it does |", "| --- | --- | --- | --- |"]
    return "\n".join(lines + [f"| {' | '.join(row)} |" for row in rows])
