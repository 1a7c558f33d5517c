"""One engine step as one jitted JAX function: a ragged batch of prefill and decode tokens
through every layer (``lax.scan`` over each stack of weights), its keys and values written
into the paged cache, and the logits of the rows the sampler needs.

The step's inputs, padded to static buckets by the runner:

- ``token_ids``, ``positions``, ``slots`` [T]: the flattened new tokens of every scheduled
  sequence, each one's position in its sequence and cache slot (``block * block_size +
  offset``). Padding tokens have the slot ``num_blocks * block_size``: past the cache, so
  their writes are dropped.
- ``query_start`` [S + 1]: where each sequence's tokens start in the flat batch (the
  padding sequences start and end at the real token count).
- ``seq_lens`` [S]: each sequence's length after this step (0 for padding).
- ``block_tables`` [S, W]: each sequence's block ids (padded with block 0).
- ``logit_rows`` [R]: which flat rows need logits.

``greedy_steps`` runs several greedy decode steps in one ``lax.while_loop``
(``--num-scheduler-steps``), each step's argmax tokens the next one's inputs.

``sample`` (jitted apart, ``jitted_sample``: its compilations depend on the rows alone)
draws each row's token from the step's logits on the device: the runner fetches the
tokens alone when that covers the step, and the logits for the engine's sampler
otherwise.

Attention reads each token's context from the cache through its sequence's block table,
a chunk of pages at a time with an online softmax (``paged_attention``): the memory it
needs is bounded by the chunk, not by the context. Each layer writes the step's keys and
values before it attends, so a sequence's new tokens attend to each other causally, as in
a prefill, and a prefix-cache hit or a recomputed sequence reads what its blocks hold.

Every product with a layer's linear weight goes through ``rvllm.jax.quant.linear``: a
plain matmul, or for an int8 or int4 weight (``--quantization``) the weight widened to the
activations' dtype inside the step and its scales applied."""

from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from rvllm.jax.cache import KVCache
from rvllm.jax.quant import linear
from rvllm.jax.weights import LayerKind, ModelSpec, StackSpec

# How many (query token, key) pairs one chunk of paged attention gathers at most: the
# chunk's pages are sized from it and the step's token count.
ATTENTION_PAIRS_PER_CHUNK = 1 << 16

# Masked scores: finite, so a query with no key in a chunk (or none at all: padding)
# makes no NaN.
_MASKED = -1e30

# The event JAX reports for every backend compilation.
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compiles = [0]


def _count_compile(event: str, duration: float, **_: Any) -> None:
    if event == _COMPILE_EVENT:
        _compiles[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compile)


def compile_count() -> int:
    """How many XLA compilations this process has made since JAX was imported."""
    return _compiles[0]


def _rms_norm(x: jax.Array, weight: jax.Array | None, eps: float, family: str = "llama"
              ) -> jax.Array:
    """As transformers: normalise in float32; Llama scales by ``w`` in the model's dtype,
    Gemma 1 to 3 by ``1 + w`` and Gemma 4 by ``w`` in float32 before the cast back (Gemma
    4's value norm has no weight)."""
    h = x.astype(jnp.float32)
    h = h * lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)
    if weight is None:
        return h.astype(x.dtype)
    if family in ("gemma1", "gemma2", "gemma3"):
        return (h * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    if family == "gemma4":
        return (h * weight.astype(jnp.float32)).astype(x.dtype)
    return weight * h.astype(x.dtype)


def _rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE; x [T, H, D], cos and sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[:, None, :].astype(x.dtype), sin[:, None, :].astype(x.dtype)
    return x * cos + rotated * sin


def _pages_per_chunk(num_tokens: int, block_size: int, width: int) -> int:
    pages = max(1, ATTENTION_PAIRS_PER_CHUNK // (num_tokens * block_size))
    return min(pages, width)


def paged_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array,
                    token_tables: jax.Array, positions: jax.Array, limit: jax.Array,
                    window: jax.Array | int, precision: Any, scale: float | None = None,
                    softcap: float | None = None) -> jax.Array:
    """Each token's attention over its sequence's keys ``[max(0, position - window + 1),
    limit)`` read from the cache of ``layer``; q [T, Hq, D], token_tables [T, W] (each
    token's block table), limit [T] (0 for padding). Scores are scaled by ``scale``
    (head_dim ** -0.5 unless given) and soft-capped at ``softcap`` if given. Returns [T,
    Hq, D] in q's dtype."""
    num_tokens, num_heads, head_dim = q.shape
    _, _, block_size, kv_heads, _ = k_cache.shape
    group = num_heads // kv_heads
    pages = _pages_per_chunk(num_tokens, block_size, token_tables.shape[1])
    chunk = pages * block_size
    width = -(-token_tables.shape[1] // pages) * pages
    token_tables = jnp.pad(token_tables, ((0, 0), (0, width - token_tables.shape[1])))
    qg = q.astype(jnp.float32).reshape(num_tokens, kv_heads, group, head_dim)
    qg = qg * (head_dim ** -0.5 if scale is None else scale)
    lower = positions - window + 1
    num_chunks = (jnp.max(limit) + chunk - 1) // chunk

    def body(c: jax.Array, state: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        m, total, acc = state
        ids = lax.dynamic_slice_in_dim(token_tables, c * pages, pages, axis=1)  # [T, pages]
        keys = k_cache[layer, ids].reshape(num_tokens, chunk, kv_heads, head_dim)
        values = v_cache[layer, ids].reshape(num_tokens, chunk, kv_heads, head_dim)
        scores = jnp.einsum("thgd,tchd->thgc", qg, keys.astype(jnp.float32),
                            precision=precision)
        if softcap is not None:
            scores = jnp.tanh(scores / softcap) * softcap
        key_pos = c * chunk + jnp.arange(chunk)
        ok = (key_pos[None, :] < limit[:, None]) & (key_pos[None, :] >= lower[:, None])
        ok = ok[:, None, None, :]
        scores = jnp.where(ok, scores, _MASKED)
        m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
        p = jnp.where(ok, jnp.exp(scores - m_new[..., None]), 0.0)
        scale = jnp.exp(m - m_new)
        total = total * scale + jnp.sum(p, axis=-1)
        acc = acc * scale[..., None] + jnp.einsum("thgc,tchd->thgd", p,
                                                  values.astype(jnp.float32),
                                                  precision=precision)
        return m_new, total, acc

    shape = (num_tokens, kv_heads, group)
    init = (jnp.full(shape, _MASKED, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros((*shape, head_dim), jnp.float32))
    _, total, acc = lax.fori_loop(0, num_chunks, body, init)
    out = acc / jnp.maximum(total, 1e-30)[..., None]
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)


class _StepInputs(NamedTuple):
    """What every layer of a step reads besides its weights and cache."""

    cos: dict[str, jax.Array]  # RoPE table name -> [T, D]
    sin: dict[str, jax.Array]
    positions: jax.Array
    blocks: jax.Array  # each token's cache block and offset
    offsets: jax.Array
    token_tables: jax.Array
    limit: jax.Array
    precision: Any


def _gemma4_layer(spec: ModelSpec, kind: LayerKind, w: dict[str, jax.Array],
                  cache: KVCache, index: jax.Array | int, h: jax.Array, x: _StepInputs,
                  per_layer: jax.Array | None, done: list[list[KVCache]]
                  ) -> tuple[jax.Array, KVCache]:
    """One Gemma 4 layer. A KV-sharing layer reads the cache of its source layer (an
    earlier stack's, in ``done``) and writes none."""
    num_tokens = h.shape[0]
    heads, kv_heads, head_dim = kind.num_heads, kind.num_kv_heads, kind.head_dim
    eps, norm = spec.rms_norm_eps, partial(_rms_norm, family="gemma4")
    dot = partial(linear, precision=x.precision)  # a plain or a quantized weight
    cos, sin = x.cos[kind.rope], x.sin[kind.rope]
    y = norm(h, w["input_norm"], eps)
    q = norm(dot(y, w["q"]).reshape(num_tokens, heads, head_dim), w["q_norm"], eps)
    q = _rope(q, cos, sin)
    if kind.kv_source is None:
        kv = dot(y, w["kv"])
        raw_k = kv[:, :kv_heads * head_dim].reshape(num_tokens, kv_heads, head_dim)
        v = raw_k if kind.k_eq_v else kv[:, kv_heads * head_dim:].reshape(raw_k.shape)
        k = _rope(norm(raw_k, w["k_norm"], eps), cos, sin)
        v = norm(v, None, eps)
        k_cache, v_cache = cache["k"], cache["v"]
        k_cache = k_cache.at[index, x.blocks, x.offsets].set(k.astype(k_cache.dtype),
                                                             mode="drop")
        v_cache = v_cache.at[index, x.blocks, x.offsets].set(v.astype(v_cache.dtype),
                                                             mode="drop")
        cache, read = {"k": k_cache, "v": v_cache}, index
    else:
        stack, position, read = kind.kv_source
        k_cache, v_cache = done[stack][position]["k"], done[stack][position]["v"]
    attn = paged_attention(q, k_cache, v_cache, read, x.token_tables, x.positions, x.limit,
                           kind.window, x.precision, spec.attn_scale)
    h = h + norm(dot(attn.reshape(num_tokens, heads * head_dim), w["o"]), w["post_norm"], eps)
    gate, up = jnp.split(dot(norm(h, w["pre_ffn_norm"], eps), w["gate_up"]), 2, axis=-1)
    h = h + norm(dot(jax.nn.gelu(gate, approximate=True) * up, w["down"]),
                 w["post_ffn_norm"], eps)
    if per_layer is not None:
        g = jax.nn.gelu(dot(h, w["ple_gate"]), approximate=True) * per_layer
        h = h + norm(dot(g, w["ple_proj"]), w["ple_norm"], eps)
    return h * w["layer_scalar"].astype(h.dtype), cache


def _layer(spec: ModelSpec, kind: LayerKind, w: dict[str, jax.Array], cache: KVCache,
           index: jax.Array | int, h: jax.Array, x: _StepInputs,
           per_layer: jax.Array | None = None, done: list[list[KVCache]] | None = None
           ) -> tuple[jax.Array, KVCache]:
    """One decoder layer: its keys and values written into layer ``index`` of ``cache``,
    attention over the cache, the MLP."""
    if spec.family == "gemma4":
        return _gemma4_layer(spec, kind, w, cache, index, h, x, per_layer, done or [])
    num_tokens = h.shape[0]
    heads, kv_heads, head_dim = kind.num_heads, kind.num_kv_heads, kind.head_dim
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    eps, gemma, family = spec.rms_norm_eps, spec.gemma, spec.family
    dot = partial(linear, precision=x.precision)  # a plain or a quantized weight
    y = _rms_norm(h, w["input_norm"], eps, family)
    qkv = dot(y, w["qkv"])
    if spec.qkv_bias:
        qkv = qkv + w["qkv_bias"]
    q = qkv[:, :q_size].reshape(num_tokens, heads, head_dim)
    k = qkv[:, q_size:q_size + kv_size].reshape(num_tokens, kv_heads, head_dim)
    v = qkv[:, q_size + kv_size:].reshape(num_tokens, kv_heads, head_dim)
    if spec.qk_norm:
        q, k = _rms_norm(q, w["q_norm"], eps, family), _rms_norm(k, w["k_norm"], eps, family)
    if kind.rope is not None:
        cos, sin = x.cos[kind.rope], x.sin[kind.rope]
    else:  # the flat layout: the layer's table chosen by its flag
        local = w["local_rope"] > 0
        cos = jnp.where(local, x.cos["local"], x.cos["global"])
        sin = jnp.where(local, x.sin["local"], x.sin["global"])
    q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    k_cache, v_cache = cache["k"], cache["v"]
    k_cache = k_cache.at[index, x.blocks, x.offsets].set(k.astype(k_cache.dtype), mode="drop")
    v_cache = v_cache.at[index, x.blocks, x.offsets].set(v.astype(v_cache.dtype), mode="drop")
    window = w["window"] if kind.window is None else kind.window
    attn = paged_attention(q, k_cache, v_cache, index, x.token_tables, x.positions, x.limit,
                           window, x.precision, spec.attn_scale, spec.attn_softcap)
    out = dot(attn.reshape(num_tokens, q_size), w["o"])
    if spec.o_bias:
        out = out + w["o_bias"]
    if spec.post_norms:  # Gemma 2 and 3
        h = h + _rms_norm(out, w["post_norm"], eps, family)
        y = _rms_norm(h, w["pre_ffn_norm"], eps, family)
        gate, up = jnp.split(dot(y, w["gate_up"]), 2, axis=-1)
        out = dot(jax.nn.gelu(gate, approximate=True) * up, w["down"])
        h = h + _rms_norm(out, w["post_ffn_norm"], eps, family)
    else:  # Llama, Gemma 1 (a GeGLU MLP)
        h = h + out
        y = _rms_norm(h, w["post_norm"], eps, family)
        gate, up = jnp.split(dot(y, w["gate_up"]), 2, axis=-1)
        act = jax.nn.gelu(gate, approximate=True) if gemma else jax.nn.silu(gate)
        h = h + dot(act * up, w["down"])
    return h, {"k": k_cache, "v": v_cache}


def _stack_forward(spec: ModelSpec, stack: StackSpec, weights: list[dict[str, Any]],
                   caches: list[KVCache], h: jax.Array, x: _StepInputs,
                   per_layer: jax.Array | None, done: list[list[KVCache]]
                   ) -> tuple[jax.Array, list[KVCache]]:
    """The hidden states through every layer of one stack: a ``lax.scan`` over its pattern
    block's repeats whose carry holds the stack's caches (so each layer's write updates
    them in place), the block's positions a static loop inside. A stack of one repeat, or
    every stack under the unrolled layout, runs as a Python loop. ``per_layer``: Gemma 4's
    per-layer inputs of the stack's layers, [repeats, positions, T, width]; ``done``: the
    caches of the stacks before this one (which KV-sharing layers read)."""

    def block(h: jax.Array, caches: list[KVCache], ws: list[dict[str, Any]],
              r: jax.Array | int, ple: jax.Array | None) -> tuple[jax.Array, list[KVCache]]:
        new = []
        for j, (kind, w, cache) in enumerate(zip(stack.pattern, ws, caches)):
            h, cache = _layer(spec, kind, w, cache, r, h, x,
                              None if ple is None else ple[j], done)
            new.append(cache)
        return h, new

    if spec.unrolled or stack.repeats == 1:
        for r in range(stack.repeats):
            h, caches = block(h, caches, jax.tree.map(lambda a, r=r: a[r], weights), r,
                              None if per_layer is None else per_layer[r])
        return h, caches

    def body(carry: tuple[jax.Array, list[KVCache]], xs: tuple[Any, ...]
             ) -> tuple[tuple[jax.Array, list[KVCache]], None]:
        return block(*carry, *xs), None

    (h, caches), _ = lax.scan(body, (h, caches),
                              (weights, jnp.arange(stack.repeats), per_layer))
    return h, caches


def _scale(value: float, dtype: Any) -> jax.Array:
    """A scale rounded to float32, then to the model's dtype, as transformers rounds
    Gemma's embedding scales."""
    return jnp.asarray(value, jnp.float32).astype(dtype)


def _per_layer_inputs(spec: ModelSpec, weights: dict[str, Any], token_ids: jax.Array,
                      h: jax.Array) -> jax.Array:
    """Gemma 4's per-layer inputs [T, layers, width]: a per-layer token embedding and a
    normed projection of the (scaled) embedding ``h``, averaged in 1/sqrt(2) measure."""
    width = spec.per_layer_size
    num_tokens = token_ids.shape[0]
    token = weights["ple_embed"][token_ids] * _scale(width ** 0.5, h.dtype)
    context = jnp.matmul(h, weights["ple_model_proj"],
                         precision=lax.Precision.HIGHEST if spec.full_precision else None)
    context = context * _scale(spec.hidden_size ** -0.5, h.dtype)
    context = _rms_norm(context.reshape(num_tokens, -1, width), weights["ple_proj_norm"],
                        spec.rms_norm_eps, "gemma4")
    return (context + token.reshape(context.shape)) * _scale(2.0 ** -0.5, h.dtype)


def _top_k_top_p_floor(logits: jax.Array, top_k: jax.Array, top_p: jax.Array
                       ) -> jax.Array:
    """Each row's smallest logit kept by its top-k (every id tied with the k-th largest)
    and top-p (the smallest set of ids whose probability reaches top_p, the top id always
    in it), as the engine's sampler keeps them; [R, 1]."""
    vocab = logits.shape[1]
    ascending = jnp.sort(logits, axis=-1)
    kth = jnp.take_along_axis(ascending, (vocab - jnp.clip(top_k, 1, vocab))[:, None], 1)
    ascending = jnp.where(ascending < kth, -jnp.inf, ascending)
    cum = jnp.cumsum(jax.nn.softmax(ascending, axis=-1), axis=-1)
    dropped = (ascending == -jnp.inf) | (cum <= (1.0 - top_p)[:, None])
    dropped = dropped.at[:, -1].set(False)
    first_kept = jnp.sum(dropped, axis=-1, keepdims=True)  # the dropped ids are a prefix
    return jnp.take_along_axis(ascending, first_kept, 1)


def sample(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
           min_p: jax.Array, seeds: jax.Array, counters: jax.Array
           ) -> tuple[jax.Array, jax.Array]:
    """A token per row of ``logits`` [R, V] (float32) and its logprob (the log-softmax of
    the raw logits at it), as the engine's sampler draws it: the argmax where temperature
    is 0; otherwise the logits divided by the temperature, masked outside top-k (0: off)
    and top-p (1: off) and below min-p times the top probability (0: off), and a draw from
    what is left. A row's draw is a function of its key alone: the key of ``seeds`` (two
    32-bit halves) folded with its ``counters`` (a seeded request's output index), so a
    seeded request draws the same tokens in any batch."""
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    filtered = (top_k > 0) | (top_p < 1.0)
    floor = lax.cond(jnp.any(filtered & (temperature > 0)),
                     lambda: _top_k_top_p_floor(scaled, jnp.where(top_k > 0, top_k,
                                                                  logits.shape[1]), top_p),
                     lambda: jnp.full((logits.shape[0], 1), -jnp.inf, logits.dtype))
    # min-p: p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p).
    floor = jnp.maximum(floor, jnp.max(scaled, axis=-1, keepdims=True)
                        + jnp.log(min_p)[:, None])
    masked = jnp.where(scaled < floor, -jnp.inf, scaled)

    def draw(seed: jax.Array, counter: jax.Array, row: jax.Array) -> jax.Array:
        key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed[0]), seed[1]),
                                 counter)
        return jax.random.categorical(key, row)

    drawn = jax.vmap(draw)(seeds, counters, masked).astype(jnp.int32)
    tokens = jnp.where(temperature > 0, drawn, greedy)
    return tokens, jnp.take_along_axis(logprobs, tokens[:, None], 1)[:, 0]


def step(weights: dict[str, Any], caches: list[list[KVCache]], token_ids: jax.Array,
         positions: jax.Array, slots: jax.Array, query_start: jax.Array,
         seq_lens: jax.Array, block_tables: jax.Array, logit_rows: jax.Array, *,
         spec: ModelSpec) -> tuple[jax.Array, list[list[KVCache]]]:
    """The logits (float32 [R, vocab]) of ``logit_rows`` and the updated caches."""
    precision = lax.Precision.HIGHEST if spec.full_precision else None
    num_tokens = token_ids.shape[0]
    # Each token's sequence: how many sequences end at or before it.
    seq_of_token = jnp.searchsorted(query_start[1:], jnp.arange(num_tokens), side="right")
    seq_of_token = jnp.minimum(seq_of_token, block_tables.shape[0] - 1)
    real = jnp.arange(num_tokens) < query_start[-1]
    # Keys [.., limit) are this token's context: its own position and those before.
    limit = jnp.where(real, jnp.minimum(positions + 1, seq_lens[seq_of_token]), 0)
    block_size = next(c["k"].shape[2] for stack in caches for c in stack if c)
    rope = weights["rope"]
    x = _StepInputs(cos={n: t["cos"][positions] for n, t in rope.items()},
                    sin={n: t["sin"][positions] for n, t in rope.items()},
                    positions=positions, blocks=slots // block_size,
                    offsets=slots % block_size, token_tables=block_tables[seq_of_token],
                    limit=limit, precision=precision)
    h = weights["embed"][token_ids]
    if spec.gemma:
        h = h * _scale(spec.hidden_size ** 0.5, h.dtype)
    per_layer = _per_layer_inputs(spec, weights, token_ids, h) if spec.per_layer_size else None
    new_caches: list[list[KVCache]] = []
    for stack, stack_weights, cache in zip(spec.stacks, weights["stacks"], caches):
        ple = None
        if per_layer is not None:  # [T, layers, width] -> [repeats, positions, T, width]
            ple = per_layer[:, stack.first:stack.first + stack.num_layers]
            ple = ple.reshape(num_tokens, stack.repeats, len(stack.pattern), -1)
            ple = ple.transpose(1, 2, 0, 3)
        h, cache = _stack_forward(spec, stack, stack_weights, cache, h, x, ple, new_caches)
        new_caches.append(cache)
    rows = _rms_norm(h[logit_rows], weights["final_norm"], spec.rms_norm_eps, spec.family)
    head = weights["embed"] if spec.tied_embeddings else weights["lm_head"]
    logits = jnp.einsum("rh,vh->rv", rows, head, precision=precision).astype(jnp.float32)
    if spec.final_softcap is not None:
        logits = jnp.tanh(logits / spec.final_softcap) * spec.final_softcap
    return logits, new_caches


def greedy_steps(weights: dict[str, Any], caches: list[list[KVCache]], token_ids: jax.Array,
                 positions: jax.Array, block_tables: jax.Array, num_seqs: jax.Array,
                 num_steps: jax.Array, stops: jax.Array, *, spec: ModelSpec, max_steps: int
                 ) -> tuple[jax.Array, jax.Array, jax.Array, list[list[KVCache]]]:
    """Up to ``num_steps`` (at most ``max_steps``) greedy decode steps of the first
    ``num_seqs`` of S sequences in one ``lax.while_loop``, each step a ``step`` of one
    token a sequence: ``token_ids`` and ``positions`` [S] are the first step's inputs,
    each step's argmax tokens the next one's, one position further on; each token's cache
    slot is read from its sequence's block table [S, W], which must cover every step's
    position. ``stops`` [S, N]: each sequence's stop tokens, padded with -1; the loop
    ends early once every sequence has made one of its own. Returns each step's tokens
    and their logprobs [max_steps, S] (the log-softmax of the logits at the token), the
    steps taken, and the updated caches."""
    num_rows = token_ids.shape[0]
    block_size = next(c["k"].shape[2] for stack in caches for c in stack if c)
    num_blocks = next(c["k"].shape[1] for stack in caches for c in stack if c)
    rows = jnp.arange(num_rows)
    real = rows < num_seqs
    query_start = jnp.minimum(jnp.arange(num_rows + 1), num_seqs).astype(jnp.int32)
    tokens = jnp.zeros((max_steps, num_rows), jnp.int32)
    logprobs = jnp.zeros((max_steps, num_rows), jnp.float32)

    def cond(carry: tuple[Any, ...]) -> jax.Array:
        i, _, _, stopped, *_ = carry
        return (i < num_steps) & ~jnp.all(stopped)

    def body(carry: tuple[Any, ...]) -> tuple[Any, ...]:
        i, ids, pos, stopped, tokens, logprobs, caches = carry
        block = jnp.take_along_axis(block_tables, (pos // block_size)[:, None], 1)[:, 0]
        slots = jnp.where(real, block * block_size + pos % block_size,
                          num_blocks * block_size)
        seq_lens = jnp.where(real, pos + 1, 0)
        logits, caches = step(weights, caches, ids, pos, slots, query_start, seq_lens,
                              block_tables, rows, spec=spec)
        found = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        logprob = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1),
                                      found[:, None], 1)[:, 0]
        stopped = stopped | jnp.any(stops == found[:, None], axis=1)
        return (i + 1, found, pos + 1, stopped, tokens.at[i].set(found),
                logprobs.at[i].set(logprob), caches)

    init = (jnp.int32(0), token_ids.astype(jnp.int32), positions.astype(jnp.int32), ~real,
            tokens, logprobs, caches)
    taken, _, _, _, tokens, logprobs, caches = lax.while_loop(cond, body, init)
    return tokens, logprobs, taken, caches


# One jitted step for the process: engines with the same model shapes, cache and buckets
# share its compilations. The caches are donated: the step updates them in place.
jitted_step = jax.jit(step, static_argnames=("spec",), donate_argnames=("caches",))
# The multi-step greedy decode: one compilation per sequence bucket and stop-token width
# for the engine's number of steps.
jitted_greedy_steps = jax.jit(greedy_steps, static_argnames=("spec", "max_steps"),
                              donate_argnames=("caches",))
# The device's sampling, apart from the step: it compiles once per number of rows.
jitted_sample = jax.jit(sample)
