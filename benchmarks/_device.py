"""Device-side timing for the GPU benchmarks (STYLE.md habit 13): what a call costs on
the device, how many kernels it launches, the chip's spec bandwidth, and torch SDPA as
the peer a PyTorch user gets, timed as a CUDA graph on the same values.

* `device_seconds`: ``n`` *dependent* calls unrolled in one jitted program (each call's
  query is the previous call's output), timed as one program (median of samples) and
  divided by ``n``: no host dispatch between calls, no loop overhead (a ``fori_loop``
  iteration costs ~11 us on an H200).
* `kernels_per_call`: the launches in the compiled program of one call: the entry
  computation's fusions, custom calls (a Pallas kernel each) and copies.
* `torch_sdpa`: ``torch.nn.functional.scaled_dot_product_attention`` on the same arrays
  (shared through DLPack, no copy), per call and as a CUDA graph of ``graph_calls`` calls.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp

from fdecode.kernels.common import chips

def spec_bandwidth() -> float | None:
  """The local GPU's HBM bandwidth by its spec (bytes / s), or None off GPU."""
  if jax.default_backend() != "gpu":
    return None
  return chips.lowering_gpu().bandwidth


def device_seconds(call, args, *, n: int = 10, iters: int = 10):
  """Seconds per call of ``call(q, *rest)`` (q = args[0]; its output must have q's shape),
  from ``n`` dependent calls unrolled in one program: (median seconds per call, compile s)."""
  def chain(q, *rest):
    for _ in range(n):
      q = call(q, *rest).astype(q.dtype)
    return q
  f = jax.jit(chain)
  t0 = time.perf_counter()
  jax.block_until_ready(f(*args))
  compile_s = time.perf_counter() - t0
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    times.append((time.perf_counter() - t0) / n)
  return statistics.median(times), compile_s


def kernels_per_call(fn, args) -> int | None:
  """Kernels one call of ``jit(fn)(*args)`` launches, read from the compiled HLO's entry
  computation (`fdecode.devtools.compile_check.entry_launches`: each fusion, custom call and copy)."""
  from fdecode.devtools.compile_check import entry_launches  # pylint: disable=g-import-not-at-top
  try:
    return entry_launches(jax.jit(fn).lower(*args).compile().as_text())
  except Exception:  # noqa: BLE001 - a backend without text: not counted
    return None


def torch_available() -> str | None:
  """None if torch with CUDA can run the peer, else why not."""
  try:
    import torch  # pylint: disable=g-import-not-at-top
  except ImportError:
    return "n/a (torch not installed)"
  if not torch.cuda.is_available():
    return "n/a (torch sees no CUDA device)"
  return None


def torch_sdpa(q, k, v, *, graph_calls: int = 50, iters: int = 10):
  """torch SDPA decode on JAX arrays: q ``[B, Hq, D]``, k / v head-major ``[B, Hkv, S, D]``
  (full sequences). Returns (per-call seconds of ``graph_calls`` back-to-back calls, seconds
  per call replayed as one CUDA graph, the output as a JAX float32 array ``[B, Hq, D]``)."""
  import torch  # pylint: disable=g-import-not-at-top
  jax.block_until_ready((q, k, v))
  tq = torch.from_dlpack(q)[:, :, None, :]
  tk, tv = torch.from_dlpack(k), torch.from_dlpack(v)
  gqa = tq.shape[1] != tk.shape[1]
  sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, enable_gqa=gqa)
  stream = torch.cuda.Stream()
  stream.wait_stream(torch.cuda.current_stream())
  with torch.cuda.stream(stream):
    for _ in range(3):
      out = sdpa()
  torch.cuda.current_stream().wait_stream(stream)
  torch.cuda.synchronize()

  def timed(run, calls):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(iters):
      start.record()
      run()
      end.record()
      end.synchronize()
      samples.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(samples)

  def eager():
    for _ in range(graph_calls):
      sdpa()
  per_call = timed(eager, graph_calls)
  graph = torch.cuda.CUDAGraph()
  with torch.cuda.graph(graph):
    for _ in range(graph_calls):
      out = sdpa()
  graph_s = timed(graph.replay, graph_calls)
  result = jnp.asarray(out[:, :, 0].float().cpu().numpy())
  del graph
  return per_call, graph_s, result
