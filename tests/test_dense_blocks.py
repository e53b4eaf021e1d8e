"""Dense prompt matmuls in blocks (``models.dense_blocks``): the same bits at any thread count,
each block the bits of its own one-thread matmul, and the native model's prompt rows on them."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from constrained_spec.models import dense_blocks
from constrained_spec.models.dense_blocks import PackedLinear, block_widths

pytestmark = pytest.mark.skipif(not dense_blocks.available(), reason="oneDNN's packed linear or the kernel is missing")


def test_block_widths_cover_the_columns_in_steps_of_sixteen():
    assert block_widths(960, 2) == [480, 480] and block_widths(576, 2) == [288, 288]
    assert block_widths(1000, 3) == [336, 336, 328] and block_widths(40, 4) == [16, 16, 8]
    assert block_widths(576, 1) == [576]
    for columns, parts in ((3072, 8), (1536, 7), (17, 2)):
        widths = block_widths(columns, parts)
        assert sum(widths) == columns and len(widths) <= parts and all(w % 16 == 0 for w in widths[:-1])


@pytest.mark.parametrize("rows,inner,columns", [(256, 576, 960), (256, 1536, 576), (77, 576, 3072), (32, 640, 2048)])
def test_the_same_bits_at_one_thread_and_two(rows, inner, columns):
    """Each block is one oneDNN matmul told it has one thread: at one thread and at two the
    output is the same, and equals each block's own ``linear`` on one thread. (A plain
    ``linear`` of the down projection's shape differs between one thread and two here: the
    library splits its reduction by the thread count.)"""
    g = torch.Generator().manual_seed(rows + inner)
    x = torch.randn(rows, inner, generator=g).bfloat16()
    w = torch.randn(columns, inner, generator=g).bfloat16()
    packed = PackedLinear(w, 2)
    before = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 1, 2):
            torch.set_num_threads(n)
            outs.append(packed(x))
            assert torch.get_num_threads() == n  # the blocks leave the process's count as it was
        torch.set_num_threads(1)
        alone = torch.cat([F.linear(x, block) for block in w.split(packed.widths)], dim=1)
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(outs[0], o) for o in outs) and torch.equal(outs[0], alone)
    want = F.linear(x.double(), w.double())
    assert (outs[0].double() - want).abs().max() <= 0.01 * want.abs().max()  # bfloat16 output rounding


@pytest.mark.slow
@torch.no_grad()
def test_the_native_models_prompt_rows_take_the_blocks():
    """After a prompt pass every dense prompt layer of the native model holds packed blocks (one
    a thread) and no second bfloat16 copy of its weights."""
    from constrained_spec.models.growing_cache import growing_cache
    from constrained_spec.models.int4 import Int4Linear, prompt_matmul_dtype
    from constrained_spec.models.loading import load_model
    from constrained_spec.models.threads import dense_threads

    if prompt_matmul_dtype() != torch.bfloat16:
        pytest.skip("prompt rows take float32 on this CPU")
    model = load_model(precision="native").model
    prompt = torch.randint(100, 49152, (1, 300), generator=torch.Generator().manual_seed(0))
    model(input_ids=prompt, cache=growing_cache(model.config.num_hidden_layers, torch.float64), use_cache=True,
          prompt_rows=prompt.shape[1] - 1)
    layers = [m for m in model.modules() if isinstance(m, Int4Linear) and m.rows is not None]
    assert layers and all(m.prompt_blocks is not None and m.prompt_weight is None for m in layers)
    assert all(len(m.prompt_blocks.widths) <= dense_threads() and sum(m.prompt_blocks.widths) == m.out_features
               for m in layers)
