"""Beam search and parallel sampling over shared pages (vLLM / TensorRT-LLM style).

Legend: L padded prompt length, V vocabulary, K beams or samples (the cache's batch B),
N new tokens (``steps``), P pages in the pool, n block-table width.

The prompt is prefilled once, as one sequence of a `PageAllocator`; the K beams or
samples are forks of it, so they share its pages (reference counts) and each holds only
the pages its own continuation fills. Before a step writes a token into a page that
several sequences still share, `PageAllocator.prepare_write` gives the writer a private
copy (copy-on-write) and `fdecode.cache.copy_pages` copies it on every layer's pool. A
beam search step reorders the beams by forking each chosen parent into a child and
freeing the old beams: a page only the dropped beams held goes back to the pool.

  model = Transformer(cfg)
  model.init_cache(batch=4, max_len=64, page_size=16)
  out = beam_search(model, prompt, beams=4, steps=16)   # out.tokens int32 [4, 16]
  out = sample_n(model, prompt, 4, steps=16, key=jax.random.key(0), temperature=0.8)

Decoding stops after N tokens (no end-of-sequence token). The K rows of the model's
cache are the K beams; prefill runs on all K rows with rows 1..K-1 empty (length 0,
block-table rows -1, so they write nothing): `DecodeAttention.prefill` has no single-row
form, so the prompt's attention and MLP run K times, though only row 0 is kept.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fdecode.cache import PageAllocator, copy_pages
from fdecode.decoding.generate import check_prompt_ids
from fdecode.models.base import Transformer

__all__ = ["Branches", "beam_search", "sample_n"]


@dataclasses.dataclass
class Branches:
  """What `beam_search` and `sample_n` return.

  Attributes:
    tokens: int32 ``[K, N]`` new tokens of each beam / sample (beams best first).
    scores: float32 ``[K]`` cumulative natural-log probability of each row's N tokens
      under the model (temperature 1), given the prompt.
    seq_ids: the K final sequences' ids in ``allocator``, still allocated (row k of
      ``tokens``); their caches hold the prompt and the first N - 1 tokens. Free them
      (``allocator.free``) when done.
    allocator: the `PageAllocator` of the model's page pool.
    pages_used: distinct pool pages the live sequences held after each of the N steps.
  """

  tokens: np.ndarray
  scores: np.ndarray
  seq_ids: list
  allocator: PageAllocator
  pages_used: list


OnStep = Callable[[int, PageAllocator, list], None]


def beam_search(model: Transformer, prompt, prompt_length: int | None = None, *, beams: int,
                steps: int, allocator: PageAllocator | None = None,
                on_step: OnStep | None = None) -> Branches:
  """Beam search: keeps the ``beams`` continuations of highest cumulative log-probability.

  Step 0 takes the K best first tokens of the prompt's distribution; each later step
  decodes the K beams as one batch and keeps the K best of the ``K * V`` (beam, token)
  extensions (ties: lower beam, then lower token id).

  Args:
    model: a `Transformer` after ``init_cache(batch=beams, max_len, page_size=...)``
      (a paged cache); its caches, block tables and lengths are overwritten.
    prompt: int ``[L]``, the prompt in ``prompt[:prompt_length]``, ids in ``[0, V)``
      (the rest is padding: ignored).
    prompt_length: in ``[1, L]``; default L.
    beams: K >= 1, at most V.
    steps: N >= 1 new tokens per beam, ``prompt_length + N - 1 <=`` the capacity
      ``allocator.max_pages_per_seq * page_size``.
    allocator: a `PageAllocator` over the model's pool (same page_size, at most P pages);
      default a fresh one over the whole pool. Other sequences it holds are left alone.
    on_step: called as ``on_step(step, allocator, seq_ids)`` after each step's forks,
      frees and copies (step 0: after the prefill).

  Returns:
    `Branches`, rows sorted by score (best first).

  Raises:
    ValueError: bad sizes or a prompt id outside ``[0, V)`` (names the argument);
      PoolExhaustedError (a ValueError) when a
      caller's ``allocator`` runs out of pages mid-search. On an error every sequence
      this call allocated is freed.
  """
  run = _Run("beam_search", model, prompt, prompt_length, beams, steps, allocator, on_step)
  if beams > model.cfg.vocab:
    raise ValueError(f"beam_search: beams={beams} exceeds the vocabulary V={model.cfg.vocab}")
  with run:
    logp = run.prefill()  # [V]
    first = np.argsort(-logp, kind="stable")[:beams]
    scores = logp[first].astype(np.float64)
    history = [[int(t)] for t in first]
    run.branch([0] * beams)
    for step in range(1, steps):
      logp = run.decode(np.array([h[-1] for h in history], np.int32))  # [K, V]
      total = (scores[:, None] + logp).reshape(-1)
      best = np.argsort(-total, kind="stable")[:beams]
      parents, tokens = best // logp.shape[1], best % logp.shape[1]
      scores = total[best]
      history = [history[p] + [int(t)] for p, t in zip(parents, tokens)]
      run.branch(parents.tolist())
    return run.result(np.array(history, np.int32), scores)


def sample_n(model: Transformer, prompt, n: int, steps: int, key, temperature: float = 1.0, *,
             prompt_length: int | None = None, allocator: PageAllocator | None = None,
             on_step: OnStep | None = None) -> Branches:
  """Parallel sampling: ``n`` independent continuations of one prompt, sharing its pages.

  Token t of sample i is ``jax.random.categorical(jax.random.fold_in(keys[i], t),
  scaled)``, ``scaled = (logp - max(logp)) / temperature`` in float32 with the maximum's
  entry exactly 0, where ``logp`` is the float32 log-softmax of the model's logits; so
  sample i equals a single-sequence run (``n=1``) with ``key=keys[i:i + 1]``. As the
  temperature goes to 0 this is greedy decoding (ties: uniform among the tied maxima),
  and so it is for a temperature that underflows float32 (below ~1.2e-38, where XLA
  flushes it to 0): never NaN, never token 0 by default.

  Args:
    model: a `Transformer` after ``init_cache(batch=n, max_len, page_size=...)``.
    prompt: int ``[L]``; ``prompt_length``: in ``[1, L]``, default L.
    n: K >= 1 samples.
    steps: N >= 1 new tokens per sample (capacity as in `beam_search`).
    key: one PRNG key (split into ``keys = jax.random.split(key, n)``), or ``keys``
      itself: a key array ``[n]`` (raw uint32 keys ``[2]`` / ``[n, 2]`` accepted).
    temperature: a real number > 0 and finite in float32 (at most ~3.4e38), the dtype
      the logits are divided in; tiny values sample the argmax (see above).
    allocator, on_step: as in `beam_search`.

  Returns:
    `Branches` in sample order.

  Raises:
    ValueError: bad sizes, keys or temperature; as `beam_search` otherwise.
  """
  run = _Run("sample_n", model, prompt, prompt_length, n, steps, allocator, on_step)
  keys = _sample_keys(key, n)
  temperature = _check_temperature(temperature)
  with run:
    logp = run.prefill()
    rows = np.broadcast_to(logp, (n, logp.shape[0]))
    tokens, scores = [], np.zeros(n)
    for step in range(steps):
      if step:
        rows = run.decode(tokens[-1])
      tok = np.asarray(_draw(jnp.asarray(rows), keys, np.int32(step), temperature))
      scores += rows[np.arange(n), tok]
      tokens.append(tok)
      if not step:
        run.branch([0] * n)
      else:
        run.report()
    return run.result(np.stack(tokens, axis=1), scores)


class _Run:
  """One search's state: the validated inputs, the allocator and the live sequence ids
  (row k of the model's cache is ``ids[k]``). As a context manager it frees every
  sequence it allocated when the search raises."""

  def __init__(self, fn, model, prompt, prompt_length, k, steps, allocator, on_step):
    for name, value in (("beams" if fn == "beam_search" else "n", k), ("steps", steps)):
      if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{fn}: {name} must be an int >= 1, got {value!r}")
    layer = model.blocks[0].attn
    if layer.cached_key is None or layer.block_tables is None:
      raise ValueError(f"{fn}: needs a paged cache; call model.init_cache(batch={k}, max_len, "
                       "page_size=...) first")
    if layer.lengths.shape[0] != k:
      raise ValueError(f"{fn}: the model's cache has batch B={layer.lengths.shape[0]}; it must be "
                       f"the number of beams / samples, {k}")
    _, pool_pages, page_size, _ = layer.cached_key.shape
    if allocator is None:
      allocator = PageAllocator(pool_pages, page_size, layer.block_tables.shape[1])
    elif not isinstance(allocator, PageAllocator) or allocator.page_size != page_size \
        or allocator.num_pages > pool_pages:
      raise ValueError(f"{fn}: allocator must be a PageAllocator with page_size={page_size} and at "
                       f"most P={pool_pages} pages (the model's pool {tuple(layer.cached_key.shape)});"
                       f" got {allocator!r}")
    prompt = np.asarray(prompt)
    if prompt.ndim != 1 or prompt.shape[0] < 1 or not np.issubdtype(prompt.dtype, np.integer):
      raise ValueError(f"{fn}: prompt must be int [L] with L >= 1; got shape {prompt.shape}, "
                       f"dtype {prompt.dtype}")
    length = prompt.shape[0] if prompt_length is None else prompt_length
    capacity = allocator.max_pages_per_seq * page_size
    if isinstance(length, bool) or not isinstance(length, (int, np.integer)) \
        or not 1 <= length <= prompt.shape[0]:
      raise ValueError(f"{fn}: prompt_length must be an int in [1, L={prompt.shape[0]}], got "
                       f"{prompt_length!r}")
    if prompt.shape[0] > capacity or length + steps - 1 > capacity:
      raise ValueError(f"{fn}: prompt of L={prompt.shape[0]} (prompt_length={length}) and "
                       f"steps={steps} need prompt_length + steps - 1 <= S and L <= S, the "
                       f"capacity S={capacity} (max_pages_per_seq * page_size)")
    prompt = check_prompt_ids(fn, "prompt", prompt, length, model.cfg.vocab)
    self.fn, self.model, self.prompt, self.length, self.k = fn, model, prompt, int(length), k
    self.alloc, self.on_step, self.step = allocator, on_step, 0
    self.tag = object()  # ids unique to this call, whatever else the allocator holds
    self.counter = itertools.count()
    self.ids: list = []
    self.mine: set = set()  # every id this call made
    self.pages_used: list = []

  def __enter__(self):
    return self

  def __exit__(self, exc_type, exc, tb):
    if exc_type is not None:
      live = set(self.alloc.seq_ids)
      for sid in self.mine & live:
        self.alloc.free(sid)
    return False

  def _new_id(self):
    sid = (self.tag, next(self.counter))
    self.mine.add(sid)
    return sid

  def prefill(self) -> np.ndarray:
    """Prefills the prompt into row 0 as one new sequence -> float32 log-probs ``[V]`` of
    the first new token."""
    pid = self._new_id()
    self.alloc.allocate(pid, self.length)
    self.ids = [pid]
    table = np.full((self.k, self.alloc.max_pages_per_seq), -1, np.int32)
    table[0] = self.alloc.block_table([pid])[0]
    _set_rows(self.model, table, np.zeros(self.k, np.int32))
    tokens = np.zeros((self.k, self.prompt.shape[0]), np.int32)
    tokens[0] = self.prompt
    lengths = np.zeros(self.k, np.int32)
    lengths[0] = self.length
    return np.asarray(_prefill_logp(self.model, jnp.asarray(tokens), jnp.asarray(lengths))[0])

  def branch(self, parents: list) -> None:
    """Row k becomes a fork of current row ``parents[k]``; the old sequences are freed
    (a page only dropped rows held returns to the pool)."""
    children = []
    for p in parents:
      children.append(self._new_id())
      self.alloc.fork(self.ids[p], children[-1])
    for sid in self.ids:
      self.alloc.free(sid)
    self.ids = children
    self.report()

  def report(self) -> None:
    self.pages_used.append(len({p for sid in self.ids for p in self.alloc.pages(sid)}))
    if self.on_step is not None:
      self.on_step(self.step, self.alloc, list(self.ids))
    self.step += 1

  def decode(self, tokens) -> np.ndarray:
    """Writes each row's last token (int ``[K]``) at position ``prompt_length + step - 1``,
    copying shared pages first -> float32 log-probs ``[K, V]`` of the next token."""
    pos = self.length + self.step - 1
    copies = [c for sid in self.ids for c in self.alloc.prepare_write(sid, pos, 1)]
    if copies:  # at most one per row (one token each): padded to K, one compiled shape
      src, dst = np.zeros(self.k, np.int32), np.full(self.k, -1, np.int32)
      src[:len(copies)], dst[:len(copies)] = zip(*copies)
      _copy_all(self.model, jnp.asarray(src), jnp.asarray(dst))
    _set_rows(self.model, self.alloc.block_table(self.ids), np.full(self.k, pos, np.int32))
    return np.asarray(_decode_logp(self.model, jnp.asarray(tokens, jnp.int32)))

  def result(self, tokens, scores) -> Branches:
    order = np.argsort(-scores, kind="stable") if self.fn == "beam_search" else np.arange(self.k)
    return Branches(tokens=tokens[order], scores=scores[order].astype(np.float32),
                    seq_ids=[self.ids[i] for i in order], allocator=self.alloc,
                    pages_used=self.pages_used)


def _set_rows(model: Transformer, table, lengths) -> None:
  """Every layer's block table := int32 ``[K, n]`` ``table``, lengths := int32 ``[K]``."""
  table, lengths = jnp.asarray(table, jnp.int32), jnp.asarray(lengths, jnp.int32)
  for block in model.blocks:
    block.attn.block_tables.set_value(table)
    block.attn.lengths.set_value(lengths)


def _sample_keys(key, n: int):
  """One key (split into n) or n keys -> a typed key array ``[n]``."""
  try:
    if not jax.dtypes.issubdtype(getattr(key, "dtype", None), jax.dtypes.prng_key):
      key = jax.random.wrap_key_data(jnp.asarray(key, jnp.uint32))  # raw uint32 keys [..., 2]
  except (TypeError, ValueError) as e:
    raise ValueError(f"sample_n: key must be a PRNG key or n={n} keys; got {key!r}") from e
  if key.shape == ():
    return jax.random.split(key, n)
  if key.shape != (n,):
    raise ValueError(f"sample_n: key must be one PRNG key or n={n} keys [n]; got key.shape={key.shape}")
  return key


def _check_temperature(temperature) -> np.float32:
  """`sample_n`'s ``temperature`` -> float32 (0 when it underflows: the greedy limit)."""
  real = isinstance(temperature, (int, float, np.integer, np.floating)) \
      and not isinstance(temperature, (bool, np.bool_))
  try:
    value = float(temperature) if real else float("nan")
  except OverflowError:  # an int beyond float64
    value = float("inf")
  if not 0 < value <= float(np.finfo(np.float32).max):
    raise ValueError(f"sample_n: temperature must be a real number > 0 and finite in float32 (at "
                     f"most {np.finfo(np.float32).max:.4g}), the dtype sampling divides in; got "
                     f"{temperature!r}")
  return np.float32(value)


@jax.jit
def _draw(logp, keys, step, temperature):
  """float32 ``[K, V]`` log-probs, keys ``[K]``, int32 step, float32 temperature ->
  int32 ``[K]`` sampled tokens (`sample_n`'s formula)."""
  z = logp - jnp.max(logp, axis=-1, keepdims=True)  # <= 0; 0 at the maxima
  scaled = jnp.where(z == 0, 0.0, z / temperature)  # T -> 0: -inf off the maxima, never 0/0
  draw = lambda k, row: jax.random.categorical(jax.random.fold_in(k, step), row)
  return jax.vmap(draw)(keys, scaled).astype(jnp.int32)


@nnx.jit
def _prefill_logp(model: Transformer, tokens, lengths):
  return jax.nn.log_softmax(model.prefill(tokens, lengths), axis=-1)


@nnx.jit
def _decode_logp(model: Transformer, tokens):
  return jax.nn.log_softmax(model.decode(tokens), axis=-1)


@nnx.jit
def _copy_all(model: Transformer, src, dst):
  """`copy_pages` (int32 ``[C]`` src -> dst, -1 dst skipped) on every layer's pool and
  per-token scales."""
  for block in model.blocks:
    layer = block.attn
    arrays = [getattr(layer, name)[...] for name in layer.cache_arrays]
    scales = dict(k_scale=arrays[2], v_scale=arrays[3]) if len(arrays) == 4 else {}
    out = copy_pages(arrays[0], arrays[1], src, dst, **scales)
    for name, value in zip(layer.cache_arrays, out):
      getattr(layer, name).set_value(value)
