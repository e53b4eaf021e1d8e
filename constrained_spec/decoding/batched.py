"""Target-only masked decoding of many prompts in one batch: one forward per step, one matcher per row.

Speculation pays when the accelerator has room to verify extra tokens for free; with a full
batch it has none, so above ``SPECULATION_MAX_BATCH`` documents the extraction pipeline runs this
path instead. Prompts are left-padded; finished rows keep stepping on a pad token, masked out.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from transformers import DynamicCache

from ..constraint import Matcher, apply_mask, masked_probs
from ..errors import InvalidOptionError, InvalidPromptError
from .stats import DecodeResult, DecodeStats

#: Above this many documents at once, speculation is switched off in favour of batching (the
#: practice of production engines: the gain of speculation fades as batching fills the device).
SPECULATION_MAX_BATCH = 8


@torch.no_grad()
def decode_batch(
    target: Any,
    matchers: list[Matcher],
    prompts: list[list[int]],
    *,
    temperature: float = 0.0,
    seed: int | None = None,
    max_new_tokens: int = 512,
) -> list[DecodeResult]:
    """Decode every prompt under its own matcher (``matchers[i]`` for ``prompts[i]``: a fresh
    ``compiled.matcher()`` each), target-only, in one batch.

    Greedy rows give the same tokens as ``decode`` on each prompt alone (up to float rounding
    of batched kernels; exact in float64). Each row's stats carry its 1/b share of the batch's
    forwards and seconds.
    """
    if not prompts or any(not p for p in prompts):
        raise InvalidPromptError("Invalid prompt: expected non-empty prompts for the batch.")
    if len(matchers) != len(prompts) or len({id(m) for m in matchers}) != len(matchers):
        raise InvalidOptionError(f"Invalid matchers: expected {len(prompts)} distinct matchers, one per prompt, "
                                 f"got {len(matchers)} ({len({id(m) for m in matchers})} distinct).")
    device = next(target.parameters()).device
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    b = len(prompts)
    width = max(len(p) for p in prompts)
    pad = matchers[0].eos_token_id
    ids = torch.full((b, width), pad, dtype=torch.long)
    attn = torch.zeros((b, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        attn[i, width - len(p):] = 1
    cache = DynamicCache(config=target.config)
    outputs: list[list[int]] = [[] for _ in range(b)]
    finished = [m.is_done(m.state) for m in matchers]
    t_start = time.perf_counter()
    forwards = 0
    target_s = constraint_s = 0.0
    step_ids, step_attn = ids, attn
    for _ in range(max_new_tokens):
        if all(finished):
            break
        # 1. One forward for every row; positions follow each row's own (unpadded) length.
        t0 = time.perf_counter()
        full_attn = attn if step_ids is ids else torch.cat([attn, step_attn], dim=1)
        positions = (full_attn.cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1]:]
        out = target(input_ids=step_ids.to(device), attention_mask=full_attn.to(device),
                     position_ids=positions.to(device), cache=cache, use_cache=True, logits_to_keep=1)
        logits = out.logits[:, -1].double().cpu()
        attn = full_attn
        forwards += 1
        t1 = time.perf_counter()
        # 2. Mask each row by its own matcher, pick, commit.
        nxt = []
        for i in range(b):
            if finished[i]:
                nxt.append(pad)
                continue
            m = matchers[i]
            row = apply_mask(logits[i], m.allowed_mask(m.state))
            if temperature == 0:
                tok = int(row.argmax())
            else:
                tok = int(torch.multinomial(masked_probs(row, temperature), 1, generator=generator))
            if tok == m.eos_token_id:
                finished[i] = True
            else:
                outputs[i].append(tok)
                m.advance([tok])
                finished[i] = m.is_done(m.state)
            nxt.append(tok)
        constraint_s += time.perf_counter() - t1
        target_s += t1 - t0
        step_ids = torch.tensor(nxt, dtype=torch.long).unsqueeze(1)
        step_attn = torch.ones((b, 1), dtype=torch.long)
    total = time.perf_counter() - t_start
    results = []
    for i in range(b):
        done = finished[i] or matchers[i].is_final(matchers[i].state)
        # Each forward and each second served the whole batch: a row's share is 1/b of them.
        st = DecodeStats(drafter="none (batched)", backend=matchers[i].compiled.backend,
                         relaxed=list(matchers[i].compiled.warnings), prompt_tokens=len(prompts[i]),
                         output_tokens=len(outputs[i]),
                         target_forwards=forwards / b, target_seconds=target_s / b,  # type: ignore[arg-type]
                         constraint_seconds=constraint_s / b, total_seconds=total / b, finished=done)
        st.finish()
        results.append(DecodeResult(outputs[i], done, st))
    return results
