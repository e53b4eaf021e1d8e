"""The row attention kernel (``models.attention_kernel``): float32 attention as accurate as torch's,
and exactly batch-invariant: a row's bits depend only on its query and the keys it may see."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from constrained_spec import config
from constrained_spec.models import attention_kernel, cpu_kernels
from constrained_spec.models.invariant import _allowed, attend_new_rows

pytestmark = pytest.mark.skipif(not attention_kernel.enabled(), reason="the attention kernel does not build here")


def _qkv(heads: int, kv_heads: int, dim: int, rows: int, keys: int, batch: int = 1, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, heads, rows, dim, generator=g) * 2, torch.randn(batch, kv_heads, keys, dim, generator=g) * 2,
            torch.randn(batch, kv_heads, keys, dim, generator=g))


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 64), (8, 2, 128), (16, 1, 64), (4, 1, 256)])
@pytest.mark.parametrize("rows", [1, 7, 21])
def test_matches_float64_attention_as_closely_as_torch_float32(heads, kv_heads, dim, rows):
    q, k, v = _qkv(heads, kv_heads, dim, rows, 300 + rows)
    allowed = None if rows == 1 else _allowed(None, 300 + rows, 300, 0, q.device)
    mask = None if allowed is None else allowed[None, None]
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, scale=dim ** -0.5,
                                          enable_gqa=True)
    stock = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=dim ** -0.5, enable_gqa=True)
    got = attention_kernel.attend(q, k, v, allowed, dim ** -0.5)
    assert got.shape == q.shape and got.dtype == torch.float32
    error, stock_error = (got.double() - want).abs().max(), (stock.double() - want).abs().max()
    # Each score is one chain of FMAs in a fixed order (the invariance): its rounding grows with
    # the chain's length, where torch's blocked sums grow with its logarithm, so 256-wide heads
    # (Gemma's) get a wider margin; still a few units of 2^-20 on outputs of order one.
    margin = 2 if dim <= 128 else 8
    assert error < margin * stock_error + 1e-6, (error, stock_error)


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 1, 256)])
@pytest.mark.parametrize("rows,masked", [(1, False), (5, True), (21, True)])
def test_bfloat16_keys_give_the_bits_of_float32_keys_of_their_values(heads, kv_heads, dim, rows, masked):
    """A bfloat16 cache (``RuntimeConfig.kv_cache``) is read as it is: the result is the float32
    kernel's on the same values widened, bit for bit (rows with and without a mask, 70 keys past
    a tile's end)."""
    keys = 198 + rows
    q, k, v = _qkv(heads, kv_heads, dim, rows, keys, seed=rows)
    k, v = k.to(torch.bfloat16), v.to(torch.bfloat16)
    allowed = _allowed(None, keys, keys - rows, 0, q.device) if masked else None
    got = attention_kernel.attend(q, k, v, allowed, dim ** -0.5)
    assert torch.equal(got, attention_kernel.attend(q, k.float(), v.float(), allowed, dim ** -0.5))
    with pytest.raises(RuntimeError, match="both float32 or both bfloat16"):
        torch.ops.constrained_spec.attend_rows(q, k, v.float(), None, 0.125)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 1, 256)])
def test_each_row_of_a_pass_has_its_one_row_bits(threads, heads, kv_heads, dim):
    """21 rows of a verify pass against each row alone in a one-token pass (the cache's view, no
    mask), on one thread and two, and every slice of the pass; the stock float32 kernel is the
    control in ``test_long_context``."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        past, rows = 300, 21
        q, k, v = _qkv(heads, kv_heads, dim, rows, past + rows, seed=1)
        alone = torch.cat([attention_kernel.attend(q[:, :, i : i + 1], k[:, :, : past + i + 1], v[:, :, : past + i + 1],
                                                   None, 0.125) for i in range(rows)], dim=2)
        for start, r in ((0, 21), (0, 1), (3, 4), (5, 12), (20, 1)):
            allowed = _allowed(None, past + start + r, past + start, 0, q.device)
            got = attention_kernel.attend(q[:, :, start : start + r], k[:, :, : past + start + r],
                                          v[:, :, : past + start + r], allowed, 0.125)
            assert torch.equal(got, alone[:, :, start : start + r]), (start, r)
    finally:
        torch.set_num_threads(old)


def test_a_row_depends_on_the_keys_it_sees_in_order_not_where_they_sit():
    """A batch row whose allowed keys sit behind padding (other positions, other rows beside it)
    gets the bits of the same keys alone, unpadded: the sums run by place in the allowed sequence."""
    q, k, v = _qkv(9, 3, 64, 3, 200, seed=2)
    want = attention_kernel.attend(q, k, v, _allowed(None, 200, 197, 0, q.device), 0.125)
    pad = 37
    kb, vb = torch.randn(2, 3, pad + 200, 64), torch.randn(2, 3, pad + 200, 64)
    kb[1, :, pad:], vb[1, :, pad:] = k[0], v[0]
    qb = torch.randn(2, 9, 3, 64)
    qb[1] = q[0]
    allowed = torch.ones(2, 1, 3, pad + 200, dtype=torch.bool)
    allowed[1, 0, :, :pad] = False
    allowed[1, 0, :, pad:] = _allowed(None, 200, 197, 0, q.device)  # causal rows behind the padding
    got = attention_kernel.attend(qb, kb, vb, allowed, 0.125)
    assert torch.equal(got[1:], want)
    assert not torch.equal(got[0], got[1])  # the other row is its own


@pytest.mark.parametrize("threads", [1, 2])
def test_rows_with_unrelated_masks_and_a_long_context_keep_their_own_bits(threads):
    """Rows whose allowed keys are not starts of each other's (holes anywhere) each get the bits
    of their row alone, over a context of many scoring tiles and more rows than one row tile; and
    the one-thread and two-thread passes agree (threads split units, never a sum)."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        keys, rows = 2600, 19
        q, k, v = _qkv(9, 3, 64, rows, keys, seed=6)
        g = torch.Generator().manual_seed(7)
        allowed = torch.rand(rows, keys, generator=g) < 0.6
        allowed[3] = False
        allowed[3, keys // 2] = True  # one key only
        got = attention_kernel.attend(q, k, v, allowed, 0.125)
        for i in range(rows):
            alone = attention_kernel.attend(q[:, :, i : i + 1], k, v, allowed[i : i + 1], 0.125)
            assert torch.equal(got[:, :, i : i + 1], alone), i
        torch.set_num_threads(3 - threads)
        assert torch.equal(attention_kernel.attend(q, k, v, allowed, 0.125), got)
    finally:
        torch.set_num_threads(old)


def test_float64_copies_of_the_keys_give_the_same_bits():
    """A cache that keeps float64 copies of float32 keys (the float64 path's cache) reads back exactly."""
    q, k, v = _qkv(9, 3, 64, 4, 100, seed=3)
    allowed = _allowed(None, 100, 96, 0, q.device)
    assert torch.equal(attention_kernel.attend(q, k.double(), v.double(), allowed, 0.125),
                       attention_kernel.attend(q, k, v, allowed, 0.125))


def test_a_row_that_sees_no_key_is_zeros_not_nan():
    q, k, v = _qkv(4, 2, 64, 2, 10, seed=4)
    allowed = torch.ones(2, 10, dtype=torch.bool)
    allowed[1] = False
    got = attention_kernel.attend(q, k, v, allowed, 0.125)
    assert torch.equal(got[:, :, 1], torch.zeros_like(got[:, :, 1])) and torch.isfinite(got).all()


def test_invariant_attention_takes_the_kernel():
    q, k, v = _qkv(9, 3, 64, 5, 50, seed=5)
    allowed = _allowed(None, 50, 45, 0, q.device)
    assert torch.equal(attend_new_rows(q, k, v, allowed, 0.125), attention_kernel.attend(q, k, v, allowed, 0.125))
    # A float64 model's rows keep the float64 path.
    assert not attention_kernel.usable(q.double(), k.double())


def test_shapes_it_does_not_compute_are_refused_by_name(monkeypatch):
    assert not attention_kernel.fits(9, 3, 96) and not attention_kernel.fits(34, 2, 64)
    q, k, v = _qkv(4, 2, 96, 1, 10)
    with pytest.raises(RuntimeError, match="head dimension 64, 128 or 256"):
        torch.ops.constrained_spec.attend_rows(q, k, v, None, 0.1)
    q, k, v = _qkv(4, 3, 64, 1, 10)
    with pytest.raises(RuntimeError, match="4 query heads over 3 key heads"):
        torch.ops.constrained_spec.attend_rows(q, k, v, None, 0.1)
    variable = config.variable("attention_kernel")
    monkeypatch.setenv(variable, "fast")
    with pytest.raises(ValueError, match="got CONSTRAINED_SPEC_ATTENTION_KERNEL='fast'"):
        config.read("attention_kernel")
    monkeypatch.setenv(variable, " OFF ")
    assert not config.read("attention_kernel")


def test_the_choice_is_made_once_from_the_first_request():
    """``ProcessChoice``: the first load's request holds; the environment only where none came; then fixed."""
    built = []
    choice = cpu_kernels.ProcessChoice("attention_kernel", lambda: built.append(1) or True)
    choice.request(False)
    choice.request(True)  # a later load's config: the process has one choice
    assert not choice() and not built
    choice = cpu_kernels.ProcessChoice("attention_kernel", lambda: built.append(1) or True)
    assert choice() and choice() and built == [1]  # built once
    choice.request(False)  # made already: no change
    assert choice()
