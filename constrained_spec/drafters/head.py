"""A learned draft head over the target's own hidden states (EAGLE-3 style), masked by the grammar.

Why a head and not a standalone small LM: a small LM pays for its own embedding, every layer and
an output projection over the whole vocabulary (for SmolLM2-135M the output projection alone is
28M of its 135M parameters), and it must read the context a second time. The head reads what the
target already computed in its verify forward (the hidden states of a low, a middle and a high
layer at every position it fed), adds one decoder layer, and predicts through a *draft
vocabulary* ``V_d``: the few thousand tokens the target actually emits under constraints. Its
cost per draft token is one small layer and a ``d x |V_d|`` projection.

The data flow, per position ``t`` of the context: ``g_t = fc([f_low; f_mid; f_high])`` (the
target's features after token ``t``), ``u_t = proj([g_t; embed(x_{t+1})])`` (the token that came
next, through the target's own frozen embedding), one Llama decoder layer over ``u_0..u_t``
(causal, its own KV cache), a final norm -> ``h_t`` -> logits over ``V_d`` for token ``x_{t+2}``.
Drafting further, the head's own ``h_t`` stands in for ``g_{t+1}`` (EAGLE-3's "training-time
test" trains it to). The draft law is ``q = softmax over M_i ∩ V_d`` of the logits at the
request's temperature (zero elsewhere, EOS excluded as for every drafter), so the verifier's
residual still reaches every token of ``M_i`` and the output law is exactly the target's; where
``M_i ∩ V_d`` is empty the head stops drafting.

The decoder hands the head the target's features of every position it keeps after a step
(``observe``); positions it never fed through a verify forward (a shared prefix taken from the
prefix cache) have none, so the head's context starts after them, as in training.
"""

from __future__ import annotations

import json
import time
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn
from transformers import DynamicCache, LlamaConfig
from transformers.models.llama.modeling_llama import (LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding,
                                                      apply_rotary_pos_emb)

from ..constraint import Matcher, State
from ..errors import InvalidOptionError, ModelLoadError, TokenizerMismatchError
from .base import Draft, Drafter, DraftGate, DraftKind, draw_masked
from .head_runner import HeadRunner
from .int8_linear import int8_kernel_available, use_int8_linears
from .order import DraftOrder, Estimates

CONFIG_FILE = "head_config.json"
WEIGHTS_FILE = "head.safetensors"
WEIGHT_FORMATS = ("float32", "bfloat16", "int8")
SCALE_SUFFIX = ".int8_scale"
#: Heads shipped in the package, one directory each (found by their tokenizer and shape).
SHIPPED_DIR = Path(__file__).resolve().parent.parent / "heads"


def default_taps(num_layers: int) -> tuple[int, int, int]:
    """Indices into the target's ``hidden_states`` (0 = embeddings, ``num_layers`` = the final,
    normed output) for the low, middle and high features, as EAGLE-3 picks them."""
    return tuple(max(1, min(num_layers, i)) for i in (2, num_layers // 2, num_layers - 3))  # type: ignore[return-value]


@dataclass(frozen=True)
class HeadConfig:
    """What a head is: its sizes, the target features it reads, its draft vocabulary and the
    tokenizer it was trained for (a head is refused on another one).

    Attributes:
        hidden_size: the target's hidden size (the head works at the same width).
        taps: indices into the target's ``hidden_states`` (see ``default_taps``).
        draft_vocab: the token ids the head can propose, ``V_d`` (sorted, EOS excluded).
        num_heads / num_kv_heads / intermediate_size: the decoder layer's shape.
        tokenizer_fingerprint: ``TokenVocabulary.fingerprint`` of the target's tokenizer.
        target: the target model's name (informative).
        rms_norm_eps / rope_theta / max_positions: as the target's.
    """

    hidden_size: int
    taps: tuple[int, ...]
    draft_vocab: tuple[int, ...]
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    tokenizer_fingerprint: str
    target: str = ""
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_positions: int = 8192

    def layer_config(self) -> LlamaConfig:
        return LlamaConfig(hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                           num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads,
                           num_hidden_layers=1, rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
                           max_position_embeddings=self.max_positions, vocab_size=1, attn_implementation="eager",
                           bos_token_id=None, eos_token_id=None, pad_token_id=None)

    @classmethod
    def for_target(cls, target: Any, tokenizer_fingerprint: str, draft_vocab: Sequence[int], *, name: str = "",
                   intermediate_size: int | None = None) -> "HeadConfig":
        """A head shaped after ``target`` (a transformers causal LM)."""
        c = target.config
        rope = getattr(c, "rope_theta", None) or (getattr(c, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        return cls(hidden_size=c.hidden_size, taps=default_taps(c.num_hidden_layers),
                   draft_vocab=tuple(sorted(set(int(t) for t in draft_vocab))), num_heads=c.num_attention_heads,
                   num_kv_heads=c.num_key_value_heads, intermediate_size=intermediate_size or c.intermediate_size,
                   tokenizer_fingerprint=tokenizer_fingerprint, target=name,
                   rms_norm_eps=c.rms_norm_eps, rope_theta=float(rope), max_positions=c.max_position_embeddings)


class DraftHead(nn.Module):
    """The head's weights (see the module docstring). ``embed`` is the target's input embedding,
    shared and frozen: it is not part of the head's state and is not saved."""

    def __init__(self, config: HeadConfig, embed: nn.Embedding) -> None:
        super().__init__()
        d = config.hidden_size
        self.config = config
        self.fc = nn.Linear(len(config.taps) * d, d, bias=False)
        self.proj = nn.Linear(2 * d, d, bias=False)
        lc = config.layer_config()
        self.layer = LlamaDecoderLayer(lc, layer_idx=0)
        self.rotary = LlamaRotaryEmbedding(lc)
        self.norm = LlamaRMSNorm(d, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(d, len(config.draft_vocab), bias=False)
        self.register_buffer("vocab_ids", torch.tensor(config.draft_vocab, dtype=torch.long), persistent=False)
        self._embed = [embed]  # a list: not registered as a submodule (not trained, not saved)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the head computes in (its norm's; int8 linears take and give it too)."""
        return self.norm.weight.dtype

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self._embed[0](tokens).to(self.dtype)

    def forward(self, g: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor,
                cache: DynamicCache | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``g`` ``[B, T, d]`` (projected target features or the head's own hidden states),
        ``next_tokens`` ``[B, T]``, ``positions`` ``[B, T]`` (absolute) -> (hidden ``[B, T, d]``,
        logits over ``V_d`` ``[B, T, |V_d|]``). Attends causally over ``cache`` and the T
        inputs; appends them to ``cache``."""
        h = self.hidden(g, next_tokens, positions, cache)
        return h, self.logits(h)

    def hidden(self, g: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor,
               cache: DynamicCache | None = None) -> torch.Tensor:
        """The decoder layer's output ``[B, T, d]`` (``forward`` without the projection)."""
        return self._layer(self.proj(torch.cat([g, self.embed(next_tokens)], dim=-1)), positions, cache)

    def prefix(self, g: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor,
               cache: DynamicCache) -> torch.Tensor:
        """``hidden(...)[:, -1:]`` with the same keys and values appended to ``cache``, computing
        only those keys and values at the positions before the last: a training sequence's
        prompt, which the later positions attend to and nothing else reads, runs without the
        layer's queries, attention and MLP there (most of its cost)."""
        u = self.proj(torch.cat([g, self.embed(next_tokens)], dim=-1))
        if u.shape[1] > 1:
            attn = self.layer.self_attn
            x = self.layer.input_layernorm(u[:, :-1])
            shape = (*x.shape[:-1], -1, attn.head_dim)
            keys = attn.k_proj(x).view(shape).transpose(1, 2)
            values = attn.v_proj(x).view(shape).transpose(1, 2)
            cos, sin = self.rotary(x, positions[:, :-1])
            _, keys = apply_rotary_pos_emb(keys, keys, cos, sin)  # the layer's own rotation of its keys
            cache.update(keys, values, 0)
        return self._layer(u[:, -1:], positions[:, -1:], cache)

    def _layer(self, u: torch.Tensor, positions: torch.Tensor, cache: DynamicCache | None) -> torch.Tensor:
        """The decoder layer over the projected inputs ``u`` ``[B, T, d]``."""
        t = u.shape[1]
        past = cache.get_seq_length() if cache is not None else 0
        mask = None
        if t > 1:  # causal within the new positions, all of the cache visible
            mask = torch.full((t, past + t), float("-inf"), dtype=u.dtype, device=u.device)
            mask = torch.triu(mask, diagonal=past + 1)[None, None]
        cos_sin = self.rotary(u, positions)
        out = self.layer(u, attention_mask=mask, position_ids=positions, cache=cache, use_cache=cache is not None,
                         position_embeddings=cos_sin)
        return out[0] if isinstance(out, tuple) else out

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits over ``V_d`` of hidden states ``[..., d]``."""
        return self.lm_head(self.norm(h))

    def project_features(self, features: torch.Tensor) -> torch.Tensor:
        """``[..., taps * d]`` target features -> ``g`` ``[..., d]``."""
        return self.fc(features.to(self.dtype))

    # -- saving and loading -------------------------------------------------------------------
    def save(self, directory: str | Path, *, weights: str = "float32") -> Path:
        """Write the config and the weights (safetensors) to ``directory``; returns it.
        ``weights``: "float32", "bfloat16" or "int8" (each matrix row scaled to int8: a
        quarter of the bytes, run by the int8 kernel where ``load_head`` can, see there)."""
        from safetensors.torch import save_file

        if weights not in WEIGHT_FORMATS:
            raise InvalidOptionError(f"Invalid weights: expected one of {', '.join(WEIGHT_FORMATS)}, got {weights!r}.")
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        (out / CONFIG_FILE).write_text(json.dumps(asdict(self.config) | {"weights": weights}, indent=1) + "\n")
        state: dict[str, torch.Tensor] = {}
        raw = self.state_dict()
        for k, v in raw.items():
            if k.endswith(".scale") and raw.get(k[: -len("scale")] + "weight", v).dtype == torch.int8:
                continue  # an int8 kernel's scales: folded into its weight below
            if v.dtype == torch.int8:  # a head loaded onto the int8 kernel: its dequantized weights
                v = v.float() * raw[k[: -len("weight")] + "scale"].float()[:, None]
            v = v.detach().float().contiguous().cpu()
            if weights == "int8" and v.dim() == 2:
                scale = (v.abs().amax(dim=1, keepdim=True) / 127).clamp_min(1e-12)
                state[k] = (v / scale).round().clamp(-127, 127).to(torch.int8)
                state[k + SCALE_SUFFIX] = scale
            else:
                state[k] = v.to(torch.bfloat16) if weights == "bfloat16" and v.dim() == 2 else v
        save_file(state, str(out / WEIGHTS_FILE))
        return out


def load_head(directory: str | Path, target: Any, tokenizer_fingerprint: str, *,
              int8_kernel: bool | None = None) -> DraftHead:
    """The head saved in ``directory``, for ``target`` (its embedding is shared). Raises
    ``TokenizerMismatchError`` when the head was trained for another tokenizer and
    ``ModelLoadError`` when the directory holds no head or one shaped for another model.

    Computed in the target's dtype when that is float64 (exactness tests), else float32. Int8
    weights stay int8 and run on the int8 kernel (``int8_linear``: a quarter of the bytes per
    draft token) when ``int8_kernel`` is True, or None and the head computes in float32 on a
    torch that has the kernel; otherwise they are dequantized."""
    from safetensors.torch import load_file

    path = Path(directory)
    if not (path / CONFIG_FILE).is_file() or not (path / WEIGHTS_FILE).is_file():
        raise ModelLoadError(f"Invalid draft head {str(path)!r}: expected {CONFIG_FILE} and {WEIGHTS_FILE} there "
                             "(train one with constrained-spec train-drafter).")
    raw = json.loads((path / CONFIG_FILE).read_text())
    raw.pop("weights", None)
    raw["taps"], raw["draft_vocab"] = tuple(raw["taps"]), tuple(raw["draft_vocab"])
    config = HeadConfig(**raw)
    if config.tokenizer_fingerprint != tokenizer_fingerprint:
        raise TokenizerMismatchError(
            f"The draft head in {str(path)!r} was trained for another tokenizer (fingerprint "
            f"{config.tokenizer_fingerprint[:12]}, the target's is {tokenizer_fingerprint[:12]}); train one for this "
            "model with constrained-spec train-drafter.")
    if config.hidden_size != target.config.hidden_size or max(config.taps) > target.config.num_hidden_layers:
        raise ModelLoadError(f"Invalid draft head {str(path)!r}: shaped for a model of hidden size "
                             f"{config.hidden_size} and {max(config.taps)}+ layers, not this target.")
    head = DraftHead(config, target.get_input_embeddings())
    stored = load_file(str(path / WEIGHTS_FILE))
    state = {k: (v.float() * stored[k + SCALE_SUFFIX] if k + SCALE_SUFFIX in stored else v.float())
             for k, v in stored.items() if not k.endswith(SCALE_SUFFIX)}
    try:
        head.load_state_dict(state)
    except RuntimeError as e:
        raise ModelLoadError(f"Invalid draft head {str(path)!r}: its weights do not fit its config ({e}).") from None
    embedding = target.get_input_embeddings()
    # A GGUF model's embedding gathers rows from a packed matrix: its dtype without dequantizing it.
    dtype = getattr(embedding, "dtype", None) or embedding.weight.dtype
    head = head.to(torch.float64 if dtype == torch.float64 else torch.float32).eval()
    if int8_kernel is None:
        int8_kernel = head.dtype == torch.float32 and int8_kernel_available()
    if int8_kernel:
        use_int8_linears(head, stored, SCALE_SUFFIX)
    return head


def shipped_head_dir(target: Any, tokenizer_fingerprint: str) -> Path | None:
    """The directory of a head shipped in the package for this target (same tokenizer, hidden
    size and depth), or None."""
    for config in sorted(SHIPPED_DIR.glob(f"*/{CONFIG_FILE}")):
        try:
            raw = json.loads(config.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if (raw.get("tokenizer_fingerprint") == tokenizer_fingerprint and raw.get("hidden_size") == target.config.hidden_size
                and max(raw.get("taps", [10**9])) <= target.config.num_hidden_layers):
            return config.parent
    return None


_LOADED: "weakref.WeakKeyDictionary[Any, dict[str, DraftHead]]" = weakref.WeakKeyDictionary()


def head_for(target: Any, tokenizer_fingerprint: str, directory: str | Path | None = None) -> DraftHead | None:
    """The head in ``directory`` (or the shipped one for ``target`` when None; None if there
    is none), loaded once per target."""
    path = Path(directory) if directory is not None else shipped_head_dir(target, tokenizer_fingerprint)
    if path is None:
        return None
    loaded = _LOADED.setdefault(target, {})
    key = str(path.resolve())
    if key not in loaded:
        loaded[key] = load_head(path, target, tokenizer_fingerprint)
    return loaded[key]


def is_head_dir(value: Any) -> bool:
    """Whether ``value`` names a directory holding a saved head."""
    return isinstance(value, (str, Path)) and (Path(value) / CONFIG_FILE).is_file()


class HeadDrafter(Drafter):
    """Drafts with a ``DraftHead`` from the target's features (see the module docstring).

    The decoder feeds it through ``observe`` after every step; ``propose`` first brings the
    head's cache up to the context it has features for, then rolls the head forward up to K
    tokens on its own hidden states, each masked by the request's matcher and ``V_d``.
    """

    name = DraftKind.HEAD
    confidence_gated = True
    #: The head drafts from the target's features only, never after other drafters' tokens in
    #: the same proposal: rolling over them costs a head step each, and it was trained to go a
    #: few steps from the target's features (see docs/performance.md).
    follows_others = False

    def __init__(self, head: DraftHead, matcher: Matcher, *, temperature: float = 0.0,
                 generator: torch.Generator | None = None) -> None:
        super().__init__(matcher)
        if temperature < 0:
            raise InvalidOptionError(f"Invalid temperature: expected a number >= 0, got {temperature!r}.")
        self.head = head
        self.temperature = temperature
        self.generator = generator
        self.taps = head.config.taps
        self.seconds = 0.0
        self.seconds_per_token, self.seconds_per_ask = 0.0, 0.0
        self._t_synced = 0.0
        self._fed_prompt = False
        self._ran = False
        #: The law's size: the target's logits (the matcher's vocabulary may be shorter: padding rows).
        self.size = max(head._embed[0].num_embeddings, matcher.vocab.size)
        self._in_vocab = torch.zeros(self.size, dtype=torch.bool)
        self._in_vocab[head.vocab_ids[head.vocab_ids < self.size]] = True
        self._in_vocab[matcher.eos_token_id] = False
        ids = head.vocab_ids
        #: Per entry of V_d: a token this drafter may propose at all (in range, not EOS).
        self._vd_ok = torch.zeros(len(ids), dtype=torch.bool)
        self._vd_ok[ids < self.size] = self._in_vocab[ids[ids < self.size]]
        #: Whether to ask the head and which of its tokens to draft, drafting alone (in a hybrid
        #: drafter the hybrid's order decides and hands its gate to ``propose_gated``).
        self.order: DraftOrder | None = None
        self.reset([])

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target ``hidden_states`` indices the decoder must hand to ``observe``."""
        return self.taps

    def timings(self) -> dict[str, float]:
        """Seconds spent proposing (feeding the head and rolling it forward)."""
        return {self.name: self.seconds}

    def reset(self, prompt_ids: list[int]) -> None:
        """Forget the previous request: no features, an empty head cache."""
        #: Absolute position of the first token with features; their tokens and features (the
        #: taps concatenated: projected only when fed, so steps where the head is not asked
        #: cost no projection).
        self.start: int | None = None
        self.tokens: list[int] = []
        self.features: list[torch.Tensor] = []
        self.runner = HeadRunner(self.head)  # the head's cache of this request, and its steps
        self.fed = 0  # pairs (g_t, x_{t+1}) in the head cache, from ``start`` on

    def set_generator(self, generator: torch.Generator | None) -> None:
        """Sample from the request's generator, so ``seed=`` reproduces the draft too."""
        self.generator = generator

    def catch_up_seconds(self, context: Sequence[int]) -> float:
        """Before this request's first ask: feeding the head every pair of the prompt and output
        it has features for, at its measured seconds per pair (0 until a request has timed
        one); after it, 0 (the pairs an ask catches up on are in its price per ask)."""
        return 0.0 if self.fed else len(self.tokens) * self.seconds_per_context_token

    def set_recent_estimates(self, recent: Any) -> None:
        """Start from the timings the last request with this head left in ``recent`` (so its
        first asks are weighed by what asking cost) and leave this request's there."""
        self.adopt_recent_timings(recent, self.head)

    def set_estimates(self, estimates: Estimates | None) -> None:
        """Drafting alone, gate each token on the K policy's estimate at its confidence."""
        self.order = DraftOrder(estimates)

    def update(self, draft: Draft, accepted: int, next_token: int) -> None:
        """Drafting alone, let the order see the verdict."""
        if self.order is not None:
            self.order.update(draft, accepted)

    @torch.no_grad()
    def observe(self, start: int, tokens: Sequence[int], features: torch.Tensor) -> None:
        """The target's features ``[len(tokens), taps * d]`` after each of ``tokens``, fed at
        absolute positions ``start..`` and kept in its cache. Earlier positions past ``start``
        (rejected drafts the decoder rolled back) are forgotten first."""
        if not tokens:
            return
        if self.start is None or start < self.start:
            self.reset([])
            self.start = start
        keep = start - self.start
        if keep > len(self.tokens):  # a gap (positions never seen): start afresh here
            self.reset([])
            self.start, keep = start, 0
        self._keep(keep)
        self.tokens.extend(int(t) for t in tokens)
        self.features.extend(features.unbind(0))

    def _keep(self, keep: int) -> None:
        """Keep the first ``keep`` tokens with features (and the pairs still valid)."""
        # Pairs (g_t, x_{t+1}) stay valid while x_{t+1} does: those with t + 1 < keep.
        self._crop(min(self.fed, max(0, keep - 1)))
        del self.tokens[keep:]
        del self.features[keep:]

    def _crop(self, pairs: int) -> None:
        if pairs < self.fed:
            self.runner.crop(pairs)
            self.fed = pairs

    @torch.no_grad()
    def _sync(self, last: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Feed the head every pair it has not seen, ending with (g of the last fed token, the
        token ``last`` that follows it); returns the head's (hidden, logits) at that pair."""
        if self.start is None or not self.tokens:
            return None
        n = len(self.tokens)
        self._crop(min(self.fed, n - 1))  # the last pair's next token may have changed
        # Pairs fed now: t = fed .. n-1, next tokens tokens[t+1] (and ``last`` for t = n-1).
        nxt = self.tokens[self.fed + 1 :] + [last]
        g = self.head.project_features(torch.stack(self.features[self.fed :]))
        h, logits = self.runner.step(g, torch.tensor(nxt), self.start + self.fed)
        self.fed = n
        return h, logits

    def _allowed(self, state: State) -> torch.Tensor:
        """Per entry of ``V_d``: whether it may be drafted at ``state`` (the matcher allows it,
        it is in range and not EOS). Greedy and sampled drafts stay on ``V_d`` (a few thousand
        entries), never the whole vocabulary."""
        mask = self.matcher.allowed_mask(state)
        ids = self.head.vocab_ids
        allowed = self._vd_ok & (ids < mask.shape[0])
        allowed[allowed.clone()] = mask[ids[allowed]]
        return allowed

    def _draw(self, masked: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """One draft token from the head's logits over ``V_d`` masked to what may be drafted,
        and its q row over the full vocabulary when sampling (zero outside ``M ∩ V_d``)."""
        ids = self.head.vocab_ids
        if self.temperature <= 0:
            return int(ids[masked.argmax()]), None
        full = torch.full((self.size,), float("-inf"), dtype=torch.float64)
        inside = ids < self.size
        full[ids[inside]] = masked[inside].double()
        return draw_masked(full, self.temperature, self.generator)

    def propose(self, context: list[int], state: State, k: int) -> Draft:
        """Up to ``k`` tokens from the head, masked by the matcher along the path and by ``V_d``
        (each gated by the K policy's estimate at its confidence when it has one)."""
        gate = None
        if self.order is not None:
            if not self.order.worth_asking(self.name, self.seconds_per_ask):
                return self.empty(state)
            gate = self.order.costly_gate([], None, self.name, self.seconds_per_token)
        return self.propose_gated(context, state, k, gate)

    @torch.no_grad()
    def propose_gated(self, context: list[int], state: State, k: int, gate: DraftGate | None) -> Draft:
        """``propose``, drafting each token only while ``gate`` (None: always) accepts the
        head's confidence in it: its probability under the head's law over ``M ∩ V_d`` (at the
        request's temperature, 1 when greedy), computed before the token is drawn."""
        if k <= 0:
            return self.empty(state)
        t0 = time.perf_counter()
        self._ran = False
        draft = self._propose(context, state, k, gate)
        t2 = time.perf_counter()
        self.seconds += t2 - t0
        # What the K policy weighs this drafter by (moving averages): per drafted token and per
        # ask that ran the head, feeding the pairs accepted since the last proposal included (a
        # head asked rarely catches up on many); the pairs its first ask feeds (the prompt's and
        # the output's so far) per pair, which ``catch_up_seconds`` prices the first ask by.
        spent = t2 - (self._t_synced if self._fed_prompt else t0)
        caught_up = (self.fed, self._t_synced - t0) if self._ran and self._fed_prompt else None
        self.record_ask(self.head, spent, len(draft.tokens), per_ask=self._ran and not self._fed_prompt,
                        keep=self._ran, caught_up=caught_up)
        return draft

    def _propose(self, context: list[int], state: State, k: int, gate: DraftGate | None) -> Draft:
        """Bring the head's cache up to the context it has features for, then draft (``_roll``)."""
        if not self._drafts_at(context):
            return self.empty(state)
        seen = self.start + len(self.tokens)  # type: ignore[operator]  # positions with target features
        self._fed_prompt = self.fed == 0
        self._ran = True
        h, logits = self._sync(context[seen])  # type: ignore[misc]
        self._t_synced = time.perf_counter()
        draft = self._roll(h, logits, seen, state, k, gate)
        self.runner.crop(self.fed)  # the draft's own pairs: the next sync feeds the accepted ones
        return draft

    def _drafts_at(self, context: list[int]) -> bool:
        """Whether the head can draft after ``context``: it has the target's features up to its
        last token (forgetting those fed past it: a step cut at the token limit), and no other
        drafter's token comes first in this proposal."""
        if self.start is None or not self.tokens:
            return False
        if self.start + len(self.tokens) >= len(context):  # fed past the context
            self._keep(max(0, len(context) - 1 - self.start))
            if not self.tokens:
                return False
        return len(context) == self.start + len(self.tokens) + 1

    def _roll(self, h: torch.Tensor, logits: torch.Tensor, pos: int, state: State, k: int,
              gate: DraftGate | None) -> Draft:
        """Up to ``k`` tokens from the head's (hidden, logits) at absolute position ``pos``, each
        masked by the matcher along the path and by ``V_d``, and drafted while ``gate`` accepts
        its confidence; the head rolls on its own hidden state in the cache beyond the context."""
        states, tokens, qs = [state], [], []
        confidence: list[float | None] = []
        for i in range(k):
            s = states[-1]
            if self.matcher.is_done(s):
                break
            allowed = self._allowed(s)
            if not bool(allowed.any()):
                break
            masked = logits.masked_fill(~allowed, float("-inf"))
            conf = float(torch.softmax(masked.double() / (self.temperature or 1.0), dim=-1).max())
            if gate is not None and not gate(conf):
                break
            x, q = self._draw(masked)
            nxt = self.matcher.next_state(s, x)
            if nxt is None:  # the mask allowed what the parser refuses (see drafters.base)
                break
            if q is not None:
                qs.append(q)
            tokens.append(x)
            confidence.append(conf)
            states.append(nxt)
            if i + 1 < k:
                h, logits = self.runner.step(h[None], torch.tensor([x]), pos + i)
        return Draft(tokens, states, torch.stack(qs) if qs else None, self.name, confidence=confidence)
