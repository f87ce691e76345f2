"""`fdecode.decoding.serving`: a small continuous-batching engine over any model whose attention
layers are `fdecode.flax.DecodeAttention` (`fdecode.models.base.Transformer`, Gemma 3).

Each step packs up to ``token_budget`` new tokens of up to ``max_seqs`` requests (decodes
first, one token each, then prefill chunks of the prompts still being read) and runs
one jit-compiled program: the model's ``ragged`` forward (`fdecode.ragged_decode` in
every layer, with the new keys and values written into one shared page pool) and the
sampling of each sequence's next token.

**Buckets.** A step runs over the smallest *bucket* that holds its live tokens, not the
whole budget: N rows, the smallest of ``buckets`` (default `token_buckets`: powers of two
up to the budget) that is >= the step's tokens, and M = min(N, max_seqs) sequence rows
(a step of n tokens holds at most n sequences). Embeddings, projections and MLP run
over N rows, the logits and the sampling over M, so a step of one decode costs about a
batch-1 decode step, not a full-budget step. Each bucket compiles once, on its first
use, and serves every mix that fits it: at most ``len(buckets)`` compilations for an
engine (engines over equal models with equal pools share them).

The weights go into the step as inputs and do not come out (`fdecode.decoding.generate.Graph`):
only the caches come back, donated, so the pool is updated in place.

Pages come from a `fdecode.cache.PageAllocator`. A request is admitted (first come,
first served: in order of ``arrival``, then of submission; a request that has not
arrived yet holds nobody back) only when a sequence slot is free and the pool has pages
for its whole prompt plus ``max_new_tokens``; otherwise it waits, and so do the requests
that arrived after it, and the running ones are never disturbed. Its pages return to the pool when it stops, at ``eos_id`` or at
``max_new_tokens``. Sampling is greedy (temperature 0) or temperature / top-k / top-p,
with a key derived from the request's seed and the token's index, so a request's tokens
do not depend on what it was batched with.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fdecode.cache.allocator import PageAllocator
from fdecode.decoding.compilation_cache import enable as enable_compilation_cache
from fdecode.decoding.generate import check_prompt_ids, model_state, split_model
from fdecode.models.base import Transformer
from fdecode.validation import INT32_MAX, describe

__all__ = ["Engine", "Finished", "Request", "StepLimitError", "StepStats", "token_buckets"]


@dataclasses.dataclass
class Request:
  """One generation request.

  Attributes:
    prompt: token ids, at least one, each in ``[0, V)``.
    max_new_tokens: tokens to generate at most (>= 1).
    temperature: 0 = greedy; otherwise a finite float > 0.
    top_k: keep the k most likely tokens (0 = all).
    top_p: keep the smallest set of tokens whose probability reaches ``top_p`` (1 = all).
    seed: the request's sampling seed (int32).
    arrival: the engine step at which it arrives (staggered arrivals); 0 = at once.
      Requests are admitted in order of arrival (then of submission), whatever order
      they were submitted in.
  """

  prompt: Sequence[int]
  max_new_tokens: int
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0
  arrival: int = 0


@dataclasses.dataclass
class Finished:
  """A stopped request: its generated ``tokens``, ``reason`` ("eos" or "length"), and the
  steps it was admitted and finished at."""

  tokens: list
  reason: str
  admitted: int
  finished: int


@dataclasses.dataclass
class StepStats:
  """One step: its clock, live decodes and prefill tokens, requests running / waiting,
  pages in use and wall seconds; the bucket it ran over (``rows`` N token rows, ``seqs`` M
  sequence rows), the tokens it generated (``sampled``: its decodes and the prefills that
  finished their prompt), and ``new_bucket``: the engine's first step over that bucket,
  whose seconds include compiling it (unless an engine over an equal model compiled
  the same shapes before)."""

  step: int
  decodes: int
  prefill_tokens: int
  running: int
  waiting: int
  pages_in_use: int
  seconds: float
  rows: int = 0
  seqs: int = 0
  sampled: int = 0
  new_bucket: bool = False


@dataclasses.dataclass
class _Live:
  rid: int
  req: Request
  admitted: int
  generated: list = dataclasses.field(default_factory=list)
  cached: int = 0  # tokens already in the cache

  @property
  def known(self) -> list:
    return list(self.req.prompt) + self.generated


class StepLimitError(RuntimeError):
  """`Engine.run` took ``max_steps`` steps and requests are still unfinished. The engine
  is intact: ``finished`` holds the requests done so far (by id), ``unfinished`` the ids
  still running or waiting; call ``run()`` again (or ``step()``) to go on."""

  def __init__(self, message, finished, unfinished):
    super().__init__(message)
    self.finished, self.unfinished = finished, unfinished


class Engine:
  """Continuous batching over one model (see the module docstring).

  Args:
    model: a `fdecode.models.base.Transformer` (or subclass, e.g. `fdecode.models.gemma3.Gemma3`);
      its caches are replaced by one page pool per layer.
    max_seqs: M, sequences per step.
    token_budget: N, new tokens per step (>= max_seqs).
    max_len: longest prompt + max_new_tokens a request may have.
    page_size: tokens per page.
    num_pages: pages the allocator hands out (default: ``max_seqs * ceil(max_len /
      page_size)``, the whole pool); fewer makes requests wait for pages.
    eos_id: stop token, an int in ``[0, V)`` (None: stop at max_new_tokens only).
    buckets: the step sizes N (token rows) a step may run over, increasing, the last one
      ``token_budget`` (default `token_buckets`): each compiles once, on first use.
    compilation_cache: JAX's persistent compilation cache, so that a later process loads the
      buckets instead of compiling them (`fdecode.decoding.compilation_cache.enable`): True
      = a folder already configured in JAX, else ``~/.cache/fdecode/jax``; a path = that
      folder (when JAX has none yet); False = fdecode turns nothing on (nor does
      ``FDECODE_COMPILATION_CACHE=0``).
    batch_invariant: True: a request's logits do not depend on what else is served, and
      equal a prefill of its tokens under the mode: every layer with a ``batch_invariant``
      attribute gets it set (attention, `fdecode.flash_decode`'s mode; the norms, matmuls and
      tied output projection of `fdecode.flax.invariant`: fixed-order sums and matmuls
      in tiles of 32 rows). ``docs/semantics.md`` (Reproducibility) says what holds where.

  The engine takes the model's weights when it is built (set them before); the model's
  caches are replaced by the pool, and hold each step's result.

  Use ``submit(request) -> id``, then ``run() -> {id: Finished}`` (or ``step()`` yourself).

  Raises:
    ValueError: a size that is not an int (bools are not) in its range, or an ``eos_id``
      that is not None or a token id.
  """

  def __init__(self, model: Transformer, *, max_seqs: int = 16, token_budget: int = 128, max_len: int = 256,
               page_size: int = 16, num_pages: int | None = None, eos_id: int | None = None,
               buckets: Sequence[int] | None = None, compilation_cache: bool | str | os.PathLike = True,
               batch_invariant: bool = False) -> None:
    for name, value, low in (("max_seqs", max_seqs, 1), ("token_budget", token_budget, max_seqs),
                             ("max_len", max_len, 1), ("page_size", page_size, 1)):
      if not _is_int(value) or not low <= value <= INT32_MAX:
        raise ValueError(f"Engine: {name} must be an int in [{low}, {INT32_MAX}]; got {describe(value)}")
    vocab = model.cfg.vocab
    if eos_id is not None and not (_is_int(eos_id) and 0 <= eos_id < vocab):
      raise ValueError(f"Engine: eos_id must be None or a token id, an int in [0, V={vocab}); got {describe(eos_id)}")
    pages_per_seq = -(-max_len // page_size)
    pool = max_seqs * pages_per_seq
    if pool > INT32_MAX or pages_per_seq * page_size > INT32_MAX:
      raise ValueError(f"Engine: the page pool's page count, max_seqs * ceil(max_len / page_size) = {pool}, and a "
                       f"sequence's capacity, {pages_per_seq * page_size} tokens, must fit in int32 (at most "
                       f"{INT32_MAX}); got max_seqs={max_seqs}, max_len={max_len}, page_size={page_size}")
    if num_pages is None:
      num_pages = pool
    if not _is_int(num_pages) or not 1 <= num_pages <= pool:
      raise ValueError(f"Engine: num_pages must be an int in [1, {pool}] (the pool); got {describe(num_pages)}")
    self.buckets = _checked_buckets(buckets, int(token_budget))
    self.alloc = PageAllocator(int(num_pages), page_size, pages_per_seq)
    if not isinstance(compilation_cache, (bool, str, os.PathLike)):
      raise ValueError(f"Engine: compilation_cache must be a bool or a folder path; got {describe(compilation_cache)}")
    if not isinstance(batch_invariant, bool):
      raise ValueError(f"Engine: batch_invariant must be a bool; got {describe(batch_invariant)}")
    # Every argument is checked: only now is the model touched (its caches become the pool).
    for _, layer in nnx.iter_graph(model):  # attention, norms and matmuls (`fdecode.flax.invariant`)
      if batch_invariant and hasattr(layer, "batch_invariant"):  # False leaves the layers as built
        layer.batch_invariant = True
    self.batch_invariant = batch_invariant
    model.init_cache(max_seqs, pages_per_seq * page_size, page_size=page_size)
    self.model, self.max_seqs, self.budget = model, int(max_seqs), int(token_budget)
    self.max_len, self.eos_id, self.vocab = int(max_len), None if eos_id is None else int(eos_id), vocab
    self.pages_per_seq = pages_per_seq
    self._graph, self._params, self._state = split_model(model)
    self._ran: set[int] = set()  # buckets this engine has run
    self.clock = 0
    self.waiting: list[tuple[int, Request]] = []
    self.running: list[_Live] = []
    self.finished: dict[int, Finished] = {}
    self.history: list[StepStats] = []
    self._next_id = 0
    if compilation_cache is not False:  # last: a rejected argument above changes no process-wide setting
      enable_compilation_cache(None if compilation_cache is True else compilation_cache)

  def submit(self, request: Request) -> int:
    """Queues a request; returns its id. A malformed one raises ValueError (naming the
    field) and changes nothing."""
    req = _checked(request, self.vocab, self.max_len, self.alloc)
    rid = self._next_id
    self._next_id += 1
    self.waiting.append((rid, req))
    return rid

  def step(self) -> StepStats | None:
    """Admits what fits, runs one batch, samples; None when nothing arrived is left."""
    self._admit()
    if not self.running:
      if not self.waiting:
        return None
      self.clock += 1  # requests still to arrive
      return None
    batch = self._schedule()
    t0 = time.perf_counter()
    arrays = self._arrays(batch)
    next_tokens, self._state = _serve_step(self._graph, self._params, self._state, *arrays)
    next_tokens = np.asarray(next_tokens)
    nnx.update(self.model, self._state)  # the model's caches: the donated ones are gone
    seconds = time.perf_counter() - t0
    decodes, sampled = sum(1 for _, n in batch if n == 1), 0
    for i, (live, n) in enumerate(batch):
      live.cached += n
      if live.cached == len(live.known):  # fed everything it knows: the sample is its next token
        live.generated.append(int(next_tokens[i]))
        sampled += 1
        self._maybe_finish(live)
    rows = len(arrays[0])
    stats = StepStats(self.clock, decodes, sum(n for _, n in batch) - decodes, len(self.running),
                      len(self.waiting), self.alloc.num_pages - self.alloc.num_free, seconds,
                      rows=rows, seqs=len(arrays[1]), sampled=sampled, new_bucket=rows not in self._ran)
    self._ran.add(rows)
    self.history.append(stats)
    self.clock += 1
    return stats

  def run(self, max_steps: int | None = None) -> dict[int, Finished]:
    """Steps until every submitted request finished; returns them by id (every request
    the engine finished, this run or before).

    ``max_steps`` (an int >= 1, or None: no limit; every request finishes in a bounded
    number of steps, as each fits the pool): the most steps this call takes, idle steps
    waiting for an arrival included.

    Raises:
      StepLimitError: requests are unfinished after ``max_steps`` steps; it carries the
        finished ones and the unfinished ids, and the engine goes on where it stopped.
      ValueError: ``max_steps`` not None or an int >= 1.
    """
    if max_steps is not None and not (_is_int(max_steps) and max_steps >= 1):
      raise ValueError(f"Engine.run: max_steps must be None or an int >= 1; got {describe(max_steps)}")
    taken = 0
    while self.running or self.waiting:
      if max_steps is not None and taken == max_steps:
        unfinished = sorted([live.rid for live in self.running] + [rid for rid, _ in self.waiting])
        raise StepLimitError(
            f"Engine.run: {len(unfinished)} request(s) unfinished after max_steps={max_steps} steps "
            f"({len(self.running)} running, {len(self.waiting)} waiting, ids {unfinished[:8]}"
            f"{'...' if len(unfinished) > 8 else ''}); call run() again to go on",
            dict(self.finished), unfinished)
      self.step()
      taken += 1
    return dict(self.finished)

  # -- internals --

  def _admit(self) -> None:
    """First come, first served: the arrived requests in order of arrival (then of
    submission); one that does not fit holds back those that arrived after it."""
    arrived = sorted((w for w in self.waiting if w[1].arrival <= self.clock), key=lambda w: (w[1].arrival, w[0]))
    for rid, req in arrived:
      need = -(-(len(req.prompt) + req.max_new_tokens) // self.alloc.page_size)
      if len(self.running) >= self.max_seqs or self.alloc.num_free < need:
        return
      self.alloc.allocate(rid, len(req.prompt) + req.max_new_tokens)
      self.waiting.remove((rid, req))
      self.running.append(_Live(rid, req, self.clock))

  def _schedule(self) -> list[tuple[_Live, int]]:
    """(request, new tokens this step): decodes first, then prefill chunks in the budget."""
    left, batch = self.budget, []
    pending = lambda live: len(live.known) - live.cached
    for live in self.running:
      if pending(live) == 1:
        batch.append((live, 1))
        left -= 1
    for live in self.running:
      if pending(live) > 1 and left > 0:
        n = min(pending(live), left)
        batch.append((live, n))
        left -= n
    return batch

  def bucket(self, tokens: int) -> tuple[int, int]:
    """(N token rows, M sequence rows) of a step carrying ``tokens`` new tokens (an int, not
    a bool, from 1 to the budget): the smallest bucket >= tokens, and min(N, max_seqs).
    Raises TypeError for a ``tokens`` that is not a number, ValueError for any other."""
    allowed = f"tokens must be an int in [1, token_budget={self.budget}]; got {describe(tokens)}"
    if not (_is_real(tokens) or isinstance(tokens, (bool, np.bool_))):
      raise TypeError(f"Engine.bucket: {allowed}")
    if not _is_int(tokens) or not 1 <= tokens <= self.budget:
      raise ValueError(f"Engine.bucket: {allowed}")
    n_rows = next(n for n in self.buckets if n >= tokens)
    return n_rows, min(n_rows, self.max_seqs)

  def _arrays(self, batch):
    n_rows, m = self.bucket(sum(n for _, n in batch))
    tokens = np.zeros(n_rows, np.int32)
    kv_lens = np.zeros(m, np.int32)
    cu = np.zeros(m + 1, np.int32)
    tables = np.zeros((m, self.pages_per_seq), np.int32)
    temperature, top_p = np.zeros(m, np.float32), np.ones(m, np.float32)
    top_k, seeds, counters = (np.zeros(m, np.int32) for _ in range(3))
    row = 0
    for i, (live, n) in enumerate(batch):
      tokens[row:row + n] = live.known[live.cached:live.cached + n]
      row += n
      cu[i + 1] = row
      kv_lens[i] = live.cached + n
      pages = self.alloc.pages(live.rid)
      tables[i, :len(pages)] = pages
      r = live.req
      temperature[i], top_k[i], top_p[i], seeds[i], counters[i] = (r.temperature, r.top_k, r.top_p, r.seed,
                                                                  len(live.generated))
    cu[len(batch) + 1:] = row
    return (tokens, kv_lens, tables, cu, np.int32(len(batch)), temperature, top_k, top_p, seeds, counters)

  def _maybe_finish(self, live: _Live) -> None:
    reason = None
    if self.eos_id is not None and live.generated[-1] == self.eos_id:
      reason = "eos"
    elif len(live.generated) >= live.req.max_new_tokens:
      reason = "length"
    if reason:
      self.running.remove(live)
      self.alloc.free(live.rid)
      self.finished[live.rid] = Finished(live.generated, reason, live.admitted, self.clock)


def _checked(req: Request, vocab: int, max_len: int, alloc: PageAllocator) -> Request:
  if not isinstance(req, Request):
    raise ValueError(f"Engine.submit: want a fdecode.decoding.serving.Request; got {type(req).__name__}")
  prompt = np.asarray(req.prompt)
  if prompt.ndim != 1 or prompt.size == 0:
    raise ValueError(f"Engine.submit: prompt must be a non-empty 1-D list of token ids; got {describe(req.prompt)}")
  prompt = check_prompt_ids("Engine.submit", "prompt", prompt, prompt.size, vocab)
  n_new = req.max_new_tokens
  if not _is_int(n_new) or n_new < 1:
    raise ValueError(f"Engine.submit: max_new_tokens must be an int >= 1; got {describe(n_new)}")
  if prompt.size + n_new > max_len:
    raise ValueError(f"Engine.submit: prompt ({prompt.size} tokens) + max_new_tokens ({n_new}) exceed the "
                     f"engine's max_len={max_len}")
  if -(-(prompt.size + n_new) // alloc.page_size) > alloc.num_pages:
    raise ValueError(f"Engine.submit: the request needs more pages than the pool holds ({alloc.num_pages})")
  # Numbers, never bools (True is an int to Python): each as the step uses it.
  t = req.temperature
  if not _is_real(t) or not (math.isfinite(t) and 0 <= t <= 3e38):
    raise ValueError(f"Engine.submit: temperature must be a finite float >= 0 (0 = greedy); got {describe(t)}")
  if not _is_int(req.top_k) or not 0 <= req.top_k <= INT32_MAX:
    raise ValueError(f"Engine.submit: top_k must be an int >= 0 (0 = all); got {describe(req.top_k)}")
  if not _is_real(req.top_p) or not 0 < req.top_p <= 1:
    raise ValueError(f"Engine.submit: top_p must lie in (0, 1]; got {describe(req.top_p)}")
  if not _is_int(req.seed) or not 0 <= req.seed <= INT32_MAX:
    raise ValueError(f"Engine.submit: seed must be an int in [0, {INT32_MAX}]; got {describe(req.seed)}")
  if not _is_int(req.arrival) or req.arrival < 0:
    raise ValueError(f"Engine.submit: arrival must be an int >= 0 (a step); got {describe(req.arrival)}")
  return dataclasses.replace(req, prompt=[int(x) for x in prompt])


def _is_int(x) -> bool:
  """A Python / numpy integer, not a bool."""
  return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_real(x) -> bool:
  """A Python / numpy real number (int or float), not a bool."""
  return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


def token_buckets(token_budget: int) -> tuple[int, ...]:
  """The default step sizes: powers of two below ``token_budget`` (an int >= 1), then the budget.

  Each bucket costs one compilation; a step pads its tokens up to its bucket, at most
  2x (less than one row in two is padding). With the demo's budget of 128: 1, 2, 4, 8,
  16, 32, 64, 128 (8 compilations, benchmarks/RESULTS.md "Serving buckets")."""
  if isinstance(token_budget, bool) or not isinstance(token_budget, (int, np.integer)) or token_budget < 1:
    raise ValueError(f"token_buckets: token_budget must be an int >= 1; got {describe(token_budget)}")
  out, n = [], 1
  while n < token_budget:
    out.append(n)
    n *= 2
  return tuple(out) + (token_budget,)


def _checked_buckets(buckets, token_budget: int) -> tuple[int, ...]:
  if buckets is None:
    return token_buckets(token_budget)
  try:
    out = tuple(buckets)
  except TypeError:
    out = None
  ok = (out and all(isinstance(n, (int, np.integer)) and not isinstance(n, bool) for n in out)
        and out[0] >= 1 and all(a < b for a, b in zip(out, out[1:])) and out[-1] == token_budget)
  if not ok:
    raise ValueError(f"Engine: buckets must be increasing ints >= 1 ending at token_budget={token_budget}; "
                     f"got {describe(buckets)}")
  return tuple(int(n) for n in out)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def _serve_step(graph, params, state, tokens, kv_lens, tables, cu, num_seqs, temperature, top_k, top_p,
                seeds, counters):
  """One step over one bucket: tokens ``[N]``, per-sequence arrays ``[M]`` (``cu`` ``[M + 1]``,
  tables ``[M, pages]``) -> (next token per sequence int32 ``[M]``, the model's non-weight
  state: the caches with the step's tokens written). ``params`` go in, not out."""
  model = graph.merge(params, state)
  logits = model.ragged(tokens, kv_lens, tables, cu, num_seqs)  # [M, V]
  return sample(logits, temperature, top_k, top_p, seeds, counters), model_state(model)


def sample(logits, temperature, top_k, top_p, seeds, counters):
  """Next token per row of float32 ``logits [M, V]``: argmax where ``temperature == 0``,
  else a draw from softmax(logits / temperature) restricted to the ``top_k`` (0: all) most
  likely tokens and to the smallest set reaching probability ``top_p``, with the key
  ``fold_in(PRNGKey(seed), counter)``. The sort runs only when some row samples."""
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

  def draw():
    def one(row, t, k, p, seed, counter):
      key = jax.random.fold_in(jax.random.PRNGKey(seed), counter)
      row = row / jnp.maximum(t, 1e-30)
      order = jnp.sort(row)[::-1]
      kth = jnp.where(k > 0, order[jnp.clip(k - 1, 0, row.shape[0] - 1)], -jnp.inf)
      probs = jax.nn.softmax(order)
      cut = jnp.argmax(jnp.cumsum(probs) >= p)  # first index reaching p
      threshold = jnp.maximum(kth, jnp.where(p < 1, order[cut], -jnp.inf))
      return jax.random.categorical(key, jnp.where(row >= threshold, row, -jnp.inf)).astype(jnp.int32)
    drawn = jax.vmap(one)(logits, temperature, top_k, top_p, seeds, counters)
    return jnp.where(temperature > 0, drawn, greedy)

  return jax.lax.cond(jnp.any(temperature > 0), draw, lambda: greedy)
