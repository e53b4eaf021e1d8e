"""The scripted layer loop of native GGUF models (``models.gguf_decode``): the same bits as
transformers' forward of the batch-invariant model, for each architecture and quant mix, for
one-token and verify passes, hidden states included, with Gemma's sliding window hiding keys."""

from __future__ import annotations

import shutil

import pytest
import torch

from constrained_spec import ModelLoadError, config, load_model
from constrained_spec.models import layer_kernels, q4_vnni
from constrained_spec.models.gguf_model import metadata_location
from tests.test_gguf_model import MIXES, SHAPE, _vocab
from tests.tiny_gguf import write_tiny_gguf

pytestmark = pytest.mark.skipif(not (q4_vnni.cpu_supports() and layer_kernels.enabled()),
                                reason="the scripted loop needs the AVX-512 kernels")

#: Gemma with seven layers (its sixth a global one, the rest sliding) and a window of 8 keys, so
#: that passes after a 20-token prompt hide keys in the sliding layers and not in the global one.
GEMMA_WINDOW = dict(layers=7, sliding_window=8)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf_decode")
    out = {arch: write_tiny_gguf(folder / f"loop-{arch}.gguf", arch=arch, types=mix, seed=10 + i,
                                 **{**SHAPE, **(GEMMA_WINDOW if arch == "gemma3" else {})}, **_vocab(arch))
           for i, (arch, mix) in enumerate(MIXES.items())}
    yield out
    for path in out.values():
        shutil.rmtree(metadata_location(path), ignore_errors=True)


def _passes(model, ids: list[int], splits: list[int], scripted: bool) -> list[torch.Tensor]:
    """A 20-token prompt pass, then passes of ``splits`` tokens each, on a cache of the model's own
    kind (bfloat16 where its prompt rows attend in bfloat16); every pass's logits and hidden states."""
    model.model.gguf_decode.enabled = scripted
    cache = model.new_cache()
    out = []
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids[:20]]), cache=cache, use_cache=True)
            at = 20
            for n in splits:
                result = model(input_ids=torch.tensor([ids[at : at + n]]), cache=cache, use_cache=True,
                               output_hidden_states=True)
                out += [result.logits, *result.hidden_states]
                at += n
    finally:
        model.model.gguf_decode.enabled = True
    return out


@pytest.mark.parametrize("precision", ["native", "float32"])
@pytest.mark.parametrize("arch", list(MIXES))
def test_the_scripted_loop_gives_transformers_forward_bits(files, arch, precision):
    """Every decode and verify pass, bit for bit, whether it runs the scripted loop or
    transformers' modules (and the loop did run: it is what the cache's positions came from)."""
    if precision == "float32" and arch not in ("llama", "gemma3"):
        pytest.skip("the dense form is checked on two architectures")
    model = load_model(str(files[arch]), precision=precision).model
    flat = model.model.gguf_decode
    assert flat is not None, "the scripted loop was not installed"
    ids = [(7 * i + 3) % 1500 + 5 for i in range(40)]
    splits = [1, 1, 4, 1, 7, 1]
    calls = []
    run = flat.run
    flat.run = lambda *a, **k: calls.append(1) or run(*a, **k)
    try:
        scripted = _passes(model, ids, splits, scripted=True)
    finally:
        flat.run = run
    assert len(calls) == len(splits)
    stock = _passes(model, ids, splits, scripted=False)
    assert len(scripted) == len(stock)
    for a, b in zip(scripted, stock):
        assert torch.equal(a, b), arch


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_bfloat16_cache_is_kept_where_asked_for_and_the_scripted_loop_reads_it(files, arch, monkeypatch):
    """``CONSTRAINED_SPEC_KV_CACHE=bfloat16``: a native load's cache keeps bfloat16 (float32 by
    default, and always for the file's exact float32 model), and every pass on it gives the same
    bits through the scripted loop and through transformers' modules, sliding layers included."""
    assert load_model(str(files[arch])).model.new_cache().layers[0].store_dtype is None
    monkeypatch.setenv(config.variable("kv_cache"), "bfloat16")
    assert load_model(str(files[arch]), precision="float32").model.new_cache().layers[0].store_dtype is None
    model = load_model(str(files[arch])).model
    assert model.new_cache().layers[0].store_dtype == torch.bfloat16
    ids = [(7 * i + 3) % 1500 + 5 for i in range(40)]
    flat, calls = model.model.gguf_decode, []
    run = flat.run
    flat.run = lambda *a, **k: calls.append(1) or run(*a, **k)
    try:
        scripted = _passes(model, ids, [1, 4, 1, 7], scripted=True)
    finally:
        flat.run = run
    stock = _passes(model, ids, [1, 4, 1, 7], scripted=False)
    assert len(calls) == 4 and len(scripted) == len(stock)
    assert all(torch.equal(a, b) for a, b in zip(scripted, stock))
    monkeypatch.setenv(config.variable("kv_cache"), "half")
    with pytest.raises(ModelLoadError, match="expected one of 'float32', 'bfloat16'"):
        load_model(str(files[arch]))


def test_gemmas_sliding_window_is_what_hides_keys(files):
    """The window matters in these passes: with it widened, the last logits differ (so the
    equality above covers the sliding mask, not a window that never hid a key)."""
    model = load_model(str(files["gemma3"])).model
    flat = model.model.gguf_decode
    ids = [(7 * i + 3) % 1500 + 5 for i in range(40)]
    narrow = _passes(model, ids, [1, 4], scripted=True)[-1]
    windows = flat.windows
    try:
        flat.windows = [None if w is None else 10_000 for w in windows]
        wide = _passes(model, ids, [1, 4], scripted=True)[-1]
    finally:
        flat.windows = windows
    assert not torch.equal(narrow, wide)
    assert len([m for m in windows if m is not None]) == 1 and None in windows  # sliding and global layers
