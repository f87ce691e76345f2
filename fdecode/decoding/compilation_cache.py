"""`fdecode.decoding.compilation_cache`: JAX's persistent compilation cache for fdecode's
long-lived programs (the serving `Engine`'s buckets, the demo's model).

An `fdecode.decoding.serving.Engine` compiles one program per bucket; for Gemma 3 270M on
a CPU that is 7-8 programs of several seconds each, the same on every run. With the cache,
a later process loads them from disk instead of compiling them again. It still traces and
lowers each one (the cache key is the lowered program): that part of a bucket's first
step stays (benchmarks/RESULTS.md, "Serving buckets").

**Where.** `enable` uses a folder JAX is already told about (``jax.config.
jax_compilation_cache_dir`` or ``$JAX_COMPILATION_CACHE_DIR``) as it is and changes
nothing else; otherwise the folder it is given, otherwise `default_dir`:
``$XDG_CACHE_HOME/fdecode/jax`` (``~/.cache/fdecode/jax``), created user-only (0700:
JAX trusts what it loads from there). JAX has one persistent cache per process, opened at
the first compile after a folder is set and kept from then on, so the first folder set wins.

**What.** Programs that took at least ``jax_persistent_cache_min_compile_time_secs``
(JAX's default, 1 s) to compile and are at least ``jax_persistent_cache_min_entry_size_bytes``
(default 0) long: an engine's buckets (seconds each) are written, the many small programs
around them are not. These are JAX's settings, left as the user has them.

**Off.** ``FDECODE_COMPILATION_CACHE=0`` (or ``false``, ``no``, ``off``) in the environment,
``Engine(..., compilation_cache=False)``: fdecode then sets nothing. A folder the user
configured in JAX stays JAX's to use; ``jax_enable_compilation_cache=False`` turns that
off too (``fdecode-demo --no-compilation-cache`` does).
"""

from __future__ import annotations

import collections
import contextlib
import os
import warnings
from typing import Iterator

import jax

__all__ = ["ENV_VAR", "counting", "default_dir", "enable"]

ENV_VAR = "FDECODE_COMPILATION_CACHE"
_OFF = frozenset({"0", "false", "no", "off"})
# JAX's events: a compile that consulted the cache, and one it answered.
_LOOKUP = "/jax/compilation_cache/compile_requests_use_cache"
_HIT = "/jax/compilation_cache/cache_hits"


def default_dir() -> str:
  """``$XDG_CACHE_HOME/fdecode/jax``, ``~/.cache/fdecode/jax`` when that is unset."""
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "fdecode", "jax")


def enable(path: str | os.PathLike | None = None) -> str | None:
  """Turns on JAX's persistent compilation cache for this process, unless it is off.

  Args:
    path: the cache folder (None: `default_dir`); used only when JAX has no folder yet.

  Returns:
    The folder JAX's compiles are cached in from now on, or None when there is none: the
    cache is off (`ENV_VAR`, ``jax_enable_compilation_cache=False``) and no folder is
    configured, or the folder cannot be created (a warning says why).
  """
  if not jax.config.jax_enable_compilation_cache:
    return None
  configured = jax.config.jax_compilation_cache_dir
  if os.environ.get(ENV_VAR, "").strip().lower() in _OFF:
    return configured or None
  if not configured and os.environ.get("JAX_COMPILATION_CACHE_DIR"):  # set after jax was imported
    configured = os.environ["JAX_COMPILATION_CACHE_DIR"]
    jax.config.update("jax_compilation_cache_dir", configured)
  if configured:
    return configured
  path = default_dir() if path is None else os.fspath(path)
  try:
    os.makedirs(path, mode=0o700, exist_ok=True)
  except OSError as e:
    warnings.warn(f"fdecode: no persistent compilation cache, cannot create {path!r}: {e}", stacklevel=2)
    return None
  jax.config.update("jax_compilation_cache_dir", path)
  return path


@contextlib.contextmanager
def counting() -> Iterator[collections.Counter]:
  """Counts this process's persistent-cache lookups while open: ``["lookups"]`` compiles
  that asked the cache, ``["hits"]`` those it answered (loaded, not compiled)."""
  counts: collections.Counter = collections.Counter()

  def listener(event: str, **_) -> None:
    if event == _LOOKUP:
      counts["lookups"] += 1
    elif event == _HIT:
      counts["hits"] += 1

  jax.monitoring.register_event_listener(listener)
  try:
    yield counts
  finally:
    jax.monitoring.unregister_event_listener(listener)
