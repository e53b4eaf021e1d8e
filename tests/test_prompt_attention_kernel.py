"""The bfloat16 prompt attention kernel (``models.prompt_attention_kernel``): its values against a
float64 reference of the same roundings, the causal mask, and the bits of a row whatever chunk,
head group or thread count it is computed in."""

from __future__ import annotations

import pytest
import torch

from constrained_spec.models import prompt_attention_kernel as kernel
from constrained_spec.models.invariant import _causal, _causal_chunk

pytestmark = pytest.mark.skipif(not kernel.available(), reason="no AVX512_BF16 kernel here (or AMX, which torch runs)")

SCALE = 0.125


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int, window: int = 0) -> torch.Tensor:
    """float64 causal attention of the bfloat16-rounded inputs, ``[1, r, h, d]`` (with a sliding
    ``window``: each row's last ``window`` keys)."""
    q, k, v = (t.to(torch.bfloat16).double() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    rows, keys = q.shape[2], k.shape[2]
    position, key = first + torch.arange(rows)[:, None], torch.arange(keys)[None, :]
    allowed = (key <= position) & ((key > position - window) if window else True)
    s = (q @ k.transpose(-1, -2) * SCALE).masked_fill(~allowed, float("-inf"))
    return (torch.softmax(s, -1) @ v).transpose(1, 2).float()


def _inputs(heads: int, kv_heads: int, dim: int, rows: int, keys: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, heads, rows, dim, generator=g), torch.randn(1, kv_heads, keys, dim, generator=g),
            torch.randn(1, kv_heads, keys, dim, generator=g))


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 1, 256), (8, 8, 128), (6, 2, 64)])
@pytest.mark.parametrize("first,rows", [(0, 1), (0, 70), (200, 57), (64, 64)])
def test_values_match_float64_of_the_bfloat16_inputs(heads, kv_heads, dim, first, rows):
    """Within the rounding of the weights to bfloat16 (about 3 significant digits) of the exact
    attention of the same bfloat16 queries, keys and values, every causal position."""
    q, k, v = _inputs(heads, kv_heads, dim, rows, first + rows, seed=first + rows + dim)
    got = kernel.attend(q, k, v, first, SCALE)
    assert got.shape == (1, rows, heads, dim) and got.dtype == torch.float32
    assert (got - _reference(q, k, v, first)).abs().max() < 1e-2


def test_a_key_past_a_rows_position_changes_none_of_its_bits():
    q, k, v = _inputs(9, 3, 64, 40, 140, seed=1)
    before = kernel.attend(q, k, v, 100, SCALE)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 120:] *= 1000  # rows 0..19 see keys up to 100..119 only
    v2[:, :, 120:] = -1e30  # finite, as a later prompt token's values are: weight 0 times it adds 0
    after = kernel.attend(q, k2, v2, 100, SCALE)
    assert torch.equal(before[:, :20], after[:, :20])
    assert not torch.equal(before[:, 20:], after[:, 20:])


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 1)])
def test_a_rows_bits_do_not_depend_on_its_chunk_or_the_thread_count(heads, kv_heads):
    """A prompt cut into chunks (decoding.prefix) attends chunk by chunk: each row must get the
    bits the whole prompt's pass gives it, at one thread as at two."""
    q, k, v = _inputs(heads, kv_heads, 64, 300, 300, seed=2)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        whole = kernel.attend(q, k, v, 0, SCALE)
        torch.set_num_threads(1)
        one_thread = kernel.attend(q, k, v, 0, SCALE)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(whole, one_thread)
    for start, rows in ((0, 128), (128, 77), (205, 95), (299, 1)):
        chunk = kernel.attend(q[:, :, start : start + rows], k[:, :, : start + rows], v[:, :, : start + rows],
                              start, SCALE)
        assert torch.equal(chunk, whole[:, start : start + rows]), (start, rows)


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 1, 256)])
@pytest.mark.parametrize("first,rows,window", [(0, 70, 0), (200, 57, 0), (150, 40, 100)])
def test_a_bfloat16_cache_gives_the_bits_of_float32_keys_it_rounds(heads, kv_heads, dim, first, rows, window):
    """Keys and values kept in bfloat16 (``RuntimeConfig.kv_cache``) are packed as they are: the
    same bits as float32 ones that the kernel rounds to those values itself."""
    q, k, v = _inputs(heads, kv_heads, dim, rows, first + rows, seed=first + rows)
    stored_k, stored_v = k.to(torch.bfloat16), v.to(torch.bfloat16)
    assert torch.equal(kernel.attend(q, stored_k, stored_v, first, SCALE, window),
                       kernel.attend(q, k, v, first, SCALE, window))


def test_the_masks_of_a_prompt_chunk_are_recognised_as_causal_and_others_are_not():
    rows, first = 5, 7
    allowed = torch.arange(first + rows)[None, :] <= first + torch.arange(rows)[:, None]
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    assert _causal(allowed[None, None], first) and _causal(additive[None, None], first)
    assert not _causal(allowed[None, None], first - 1)
    padded = allowed.clone()
    padded[:, 0] = False  # a left-padded row hides its first key
    assert not _causal(padded[None, None], first)
    assert not _causal(allowed[None, None].repeat(2, 1, 1, 1), first)  # two batch rows
    half_hidden = additive.masked_fill(~allowed, -1.0)  # a bias, not a mask
    assert not _causal(half_hidden[None, None], first)


def test_a_forwards_mask_is_checked_once_a_chunk_and_again_when_it_changes():
    """The check shared by a forward's layers (``_causal_chunk``) answers for the mask it is
    handed: another chunk, another window, a changed mask or another mask are checked anew."""
    keys = 12
    allowed = (torch.arange(keys)[None, :] <= torch.arange(keys)[:, None])[None, None]
    assert _causal_chunk(allowed, 0, 4, 4, 8, 0) and _causal_chunk(allowed, 0, 4, 4, 8, 0)
    assert not _causal_chunk(allowed, 0, 4, 4, 8, 3)  # a window the mask does not have
    allowed[0, 0, 5, 6] = True  # changed in place: row 5 sees a later key
    assert not _causal_chunk(allowed, 0, 4, 4, 8, 0)
    assert _causal_chunk(allowed, 0, 0, 4, 4, 0)  # an earlier chunk, untouched by the change
    other = (torch.arange(keys)[None, :] <= torch.arange(keys)[:, None])[None, None]
    assert _causal_chunk(other, 0, 4, 4, 8, 0)


@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 1, 256), (9, 3, 64)])
@pytest.mark.parametrize("window,first,rows", [(512, 0, 300), (512, 700, 200), (100, 37, 150), (64, 130, 70),
                                               (1, 5, 9), (4096, 10, 50)])
def test_a_sliding_window_sees_each_rows_last_keys_only(heads, kv_heads, dim, window, first, rows):
    """Gemma 3's local layers: row ``i`` sees keys ``first + i - window + 1 .. first + i``, tiles
    at any offset from the window's start, a window of one key, and one wider than the prompt."""
    q, k, v = _inputs(heads, kv_heads, dim, rows, first + rows, seed=window + first + rows)
    got = kernel.attend(q, k, v, first, SCALE, window)
    assert (got - _reference(q, k, v, first, window)).abs().max() < 1e-2
    # Keys before the window change nothing: the rows' bits are those of keys that were never there.
    start = max(0, first - window + 1)  # the first key row 0 sees
    if start:
        k2, v2 = k.clone(), v.clone()
        k2[:, :, :start] *= 1000
        v2[:, :, :start] = -1e30
        assert torch.equal(kernel.attend(q, k2, v2, first, SCALE, window), got)


def test_a_windowed_rows_bits_do_not_depend_on_its_chunk_or_the_thread_count():
    q, k, v = _inputs(4, 1, 256, 600, 600, seed=3)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        whole = kernel.attend(q, k, v, 0, SCALE, 200)
        torch.set_num_threads(1)
        one_thread = kernel.attend(q, k, v, 0, SCALE, 200)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(whole, one_thread)
    for start, rows in ((0, 256), (256, 256), (512, 88), (333, 1)):
        chunk = kernel.attend(q[:, :, start : start + rows], k[:, :, : start + rows], v[:, :, : start + rows],
                              start, SCALE, 200)
        assert torch.equal(chunk, whole[:, start : start + rows]), (start, rows)


def test_a_sliding_mask_is_recognised_with_its_window_only():
    rows, first, window = 6, 9, 4
    position, key = first + torch.arange(rows)[:, None], torch.arange(first + rows)[None, :]
    sliding = ((key <= position) & (key > position - window))[None, None]
    assert _causal(sliding, first, window)
    assert not _causal(sliding, first) and not _causal(sliding, first, window + 1)
    assert not _causal((key <= position)[None, None], first, window)  # a causal mask is not a window's
