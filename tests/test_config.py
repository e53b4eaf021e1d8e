"""The runtime configuration (``constrained_spec.config``): every variable's values and default as
the library took them before they were gathered here, one error class and one message for a bad
value, one table in the docs, and no other module of the library reading the environment."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from constrained_spec import InvalidOptionError, ModelLoadError, config, load_model
from constrained_spec.config import RuntimeConfig, RuntimeConfigError
from constrained_spec.storage import cache_dir

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "constrained_spec"


def _from(**variables: str) -> RuntimeConfig:
    return RuntimeConfig.from_env({config.variable(field): value for field, value in variables.items()})


def test_an_empty_environment_gives_the_defaults():
    assert RuntimeConfig.from_env({}) == RuntimeConfig()
    assert RuntimeConfig() == RuntimeConfig(int4_kernel=None, output_kernel=None, attention_kernel=True,
                                            layer_kernels=True, cuda_graphs=True, threads="auto", cache_dir=None,
                                            constraint_cache_mb=256.0, profile=None)


@pytest.mark.parametrize("field, raw, value", [
    ("int4_kernel", "", None), ("int4_kernel", " VNNI ", "vnni"), ("int4_kernel", "vnni-int8", "vnni-int8"),
    ("int4_kernel", "torch", "torch"),
    ("output_kernel", "", None), ("output_kernel", "vnni", "vnni"), ("output_kernel", "Torch", "torch"),
    ("attention_kernel", "", True), ("attention_kernel", "on", True), ("attention_kernel", " OFF", False),
    ("layer_kernels", "off", False), ("layer_kernels", "ON", True),
    ("threads", "", "auto"), ("threads", "Auto", "auto"), ("threads", "off", "off"), ("threads", " 3 ", 3),
    ("cache_dir", "", None), ("cache_dir", "/tmp/cs cache", Path("/tmp/cs cache")),
    ("constraint_cache_mb", "0", 0.0), ("constraint_cache_mb", "0.5", 0.5), ("constraint_cache_mb", "1e3", 1000.0),
    ("heap_keep_mb", "", 256), ("heap_keep_mb", " 0 ", 0), ("heap_keep_mb", "1024", 1024),
    ("profile", "", None), ("profile", "gb200-nvl72", "gb200-nvl72"),
])
def test_each_variable_takes_the_values_it_took(field, raw, value):
    assert getattr(_from(**{field: raw}), field) == value


@pytest.mark.parametrize("raw, on", [(None, True), ("", True), ("on", True), ("1", True), ("TRUE", True), ("yes", True),
                                     ("off", False), ("OFF", False), ("0", False), ("False", False), ("no", False)])
def test_cuda_graphs_takes_the_spellings_it_took(raw, on):
    """The old check switched graphs off for off / 0 / false / no in any case and on for anything
    else; the spellings of on it took are kept and other words refused (the next test)."""
    environ = {} if raw is None else {"CONSTRAINED_SPEC_CUDA_GRAPHS": raw}
    assert RuntimeConfig.from_env(environ).cuda_graphs is on


@pytest.mark.parametrize("field, raw", [
    ("int4_kernel", "fast"), ("output_kernel", "fast"), ("attention_kernel", "fast"), ("layer_kernels", "1"),
    ("cuda_graphs", "maybe"), ("threads", "0"), ("threads", "-1"), ("threads", "two"),
    ("constraint_cache_mb", "lots"), ("constraint_cache_mb", "-1"), ("constraint_cache_mb", "nan"),
    ("heap_keep_mb", "-1"), ("heap_keep_mb", "0.5"), ("heap_keep_mb", "lots"),
    ("profile", "tpu-v5"), ("profile", "CPU"),
])
def test_a_bad_value_names_the_variable_the_value_and_the_values_it_takes(field, raw):
    variable = config.variable(field)
    with pytest.raises(RuntimeConfigError) as caught:
        _from(**{field: raw})
    message = str(caught.value)
    assert re.fullmatch(rf"Invalid [\w ]+: expected .+, got {variable}={raw!r}\.", message), message
    # One class that every former catch still catches.
    assert isinstance(caught.value, ModelLoadError) and isinstance(caught.value, InvalidOptionError)
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize("values", [dict(int4_kernel="fast"), dict(output_kernel="vnni-int8"), dict(threads=0),
                                    dict(threads=True), dict(threads="2"), dict(cuda_graphs="off"),
                                    dict(constraint_cache_mb=-1), dict(heap_keep_mb=-1), dict(heap_keep_mb=1.5),
                                    dict(profile="tpu")])
def test_a_config_built_in_code_is_checked_the_same_way(values):
    (field, value), = values.items()
    with pytest.raises(RuntimeConfigError, match=rf"got {field}={re.escape(repr(value))}\.$"):
        RuntimeConfig(**values)


def test_the_config_is_frozen_and_says_its_derived_values(tmp_path):
    cfg = RuntimeConfig(cache_dir=str(tmp_path), constraint_cache_mb=1.5)
    assert cfg.cache_dir == tmp_path and cfg.cache_root == tmp_path and cfg.constraint_cache_bytes == 3 << 19
    with pytest.raises(AttributeError):
        cfg.threads = 1  # type: ignore[misc]
    assert RuntimeConfig().cache_root == config.default_cache_dir()


def test_the_cache_folder_follows_the_variable_at_each_call(monkeypatch, tmp_path):
    monkeypatch.setenv("CONSTRAINED_SPEC_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.delenv("CONSTRAINED_SPEC_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "constrained_spec"


def test_load_model_reads_the_environment_once_and_refuses_a_bad_value_before_loading(monkeypatch):
    monkeypatch.setenv("CONSTRAINED_SPEC_CUDA_GRAPHS", "maybe")
    with pytest.raises(ModelLoadError, match="got CONSTRAINED_SPEC_CUDA_GRAPHS='maybe'"):
        load_model(precision="float32")
    # A config given explicitly is used instead of the environment.
    handle = load_model(precision="float32", config=RuntimeConfig())
    assert handle.precision == "float32"


def test_the_docs_table_lists_every_variable():
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert config.docs_table() in page
    source = "\n".join(p.read_text() for p in PACKAGE.rglob("*.py"))
    named = set(re.findall(r"CONSTRAINED_SPEC_[A-Z0-9_]*[A-Z0-9]", source))
    listed = {s.variable for s in config.SETTINGS} | {row[0] for row in config.CLIENT_VARIABLES}
    assert named <= listed, named - listed


def test_only_the_config_reads_the_runtime_variables():
    """The models, the cache folder and the profiles take their settings from ``config``; the
    environment is read in the modules of client-side variables only (the command line, the
    remote client, the benchmarks' data) and, until it moves, the constraint cache's bound."""
    readers = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
               if re.search(r"os\.environ|getenv", p.read_text())}
    runtime = {p for p in readers if p.startswith("models/") or p in ("storage.py", "decoding/profiles.py")}
    assert runtime == set(), runtime
