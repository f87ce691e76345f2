"""Greedy generation with a random-weight transformer whose attention is FlashDecode
sharded over 8 (simulated) devices, timed and checked token for token against the same
model with the float32 reference attention on one device.

The mesh splits kv heads over "heads" and the cache's token axis over "seq"
(`fdecode.sharded_flash_decode`). ``--kernel --help``: the single-step kernel benchmark
(one FlashDecode call over a 16K-token cache).

The demo's ``--synthetic`` (``fdecode-demo --synthetic``, ``scripts/demo --synthetic``), or
``python -m fdecode.cli.synthetic``.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import fdecode
from fdecode import cli
from fdecode.decoding.generate import generate
from fdecode.models.base import ModelConfig, Transformer

_KERNEL_DOC = "One FlashDecode step over a long cache, timed and checked against the reference."
_HOST_DEVICES_FLAG = "--xla_force_host_platform_device_count"
# Tolerance on |logits - reference logits| (float32 model; observed ~1e-5).
_LOGITS_ATOL = 1e-3


def main(argv=None, prog: str | None = None) -> int:
  """Entry point: ``argv`` defaults to ``sys.argv[1:]``, ``prog`` (usage lines, ``--help``)
  to the command the user ran. Returns the exit status (0 OK, 1 a mismatch)."""
  argv = sys.argv[1:] if argv is None else list(argv)
  prog = prog or cli.prog("fdecode.cli.synthetic")
  if "--kernel" in argv:
    return kernel_main([a for a in argv if a != "--kernel"], prog=f"{prog} --kernel")
  return generate_main(argv, prog)


def ensure_host_devices(n: int) -> None:
  """Asks XLA for ``n`` simulated CPU devices. JAX reads XLA_FLAGS when its backend first
  starts (the first device query or computation, not the import), so this works from
  ``main`` unless something already started it (then the existing devices are used)."""
  flags = os.environ.get("XLA_FLAGS", "")
  if _HOST_DEVICES_FLAG not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} {_HOST_DEVICES_FLAG}={n}".strip()


# More simulated devices than this is no demo.
_MAX_DEVICES = 512


def _check_sizes(p: argparse.ArgumentParser, sizes: dict) -> None:
  """Each option an int in ``[1, 2**31 - 1]`` (sizes are int32 on the device)."""
  for name, value in sizes.items():
    if not 1 <= value <= 2**31 - 1:
      p.error(f"{name} must be in [1, 2**31 - 1], got {value}")


def _check_memory(p: argparse.ArgumentParser, nbytes: int, what: str) -> None:
  """An argparse error when ``what`` (``nbytes``) would not fit this machine's memory,
  rather than an allocation that fails (or swaps) minutes later."""
  try:
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (AttributeError, OSError, ValueError):  # pragma: no cover - not POSIX
    return
  if nbytes > total:
    p.error(f"{what} would need {nbytes / 2**30:.4g} GiB, more than this machine's "
            f"{total / 2**30:.4g} GiB of memory; use smaller sizes")


def progress_bar(label: str):
  """A text progress bar on stderr: ``on_step(done, total)``. On a terminal it redraws one
  line (``\\r``); otherwise (a log, a pipe) it writes a line at each tenth of the way and at
  the end, so that logs hold no carriage returns and at most 11 lines per bar."""
  t0 = time.perf_counter()
  last_tenth = -1

  def on_step(done, total):
    nonlocal last_tenth
    err = sys.stderr
    tty = getattr(err, "isatty", lambda: False)()
    tenth = 10 * done // total
    if not tty and tenth == last_tenth and done != total:
      return
    last_tenth = tenth
    sys.stdout.flush()  # keep the bar after what was printed before it
    width = 30
    fill = width * done // total
    line = (f"  {label:<9} [{'#' * fill}{'.' * (width - fill)}] {done}/{total} tokens "
            f"{time.perf_counter() - t0:5.1f}s")
    if tty:
      err.write(f"\r{line}" + ("\n" if done == total else ""))
    else:
      err.write(f"{line}\n")
    err.flush()
  return on_step


# --cache kinds: DecodeAttention.init_cache options.
CACHE_KINDS = {
    "contiguous": dict(cache_dtype=None, page_size=None),
    "paged": dict(cache_dtype=None, page_size=16),
    "int8": dict(cache_dtype=jnp.int8, page_size=None),
}


def _generate_args(argv, prog: str):
  """The generation demo's arguments -> (args, `ModelConfig`, (HEADS, SEQ) mesh sizes);
  argparse-style errors (usage, message, exit 2) for sizes no run could use."""
  p = argparse.ArgumentParser(prog=prog, description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--context", type=int, default=4096, help="cache capacity S (tokens)")
  p.add_argument("--batch", type=int, default=4, help="sequences B, with different prompt lengths")
  p.add_argument("--steps", type=int, default=32, help="new tokens per sequence")
  p.add_argument("--cache", choices=sorted(CACHE_KINDS), default="contiguous",
                 help="KV cache: contiguous float32, paged float32 (pages of 16), or contiguous int8 "
                      "with per-token scales")
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--dim", type=int, default=256, help="model width E")
  p.add_argument("--heads", type=int, default=None, help="query heads Hq (default E/32)")
  p.add_argument("--kv-heads", type=int, default=None, help="kv heads Hkv (default Hq/2)")
  p.add_argument("--vocab", type=int, default=512)
  p.add_argument("--mesh", default="2x4", help="HEADSxSEQ devices (default 2x4 = 8 devices)")
  p.add_argument("--seed", type=int, default=0, help="weights and prompts")
  p.add_argument("--kernel", action="store_true", help="run the single-step kernel benchmark instead")
  a = p.parse_args(argv)

  try:
    n_heads_axis, n_seq_axis = (int(x) for x in a.mesh.lower().split("x"))
  except ValueError:
    p.error(f"--mesh must be HEADSxSEQ, e.g. 2x4; got {a.mesh!r}")
  if min(n_heads_axis, n_seq_axis) < 1 or n_heads_axis * n_seq_axis > _MAX_DEVICES:
    p.error(f"--mesh must be HEADSxSEQ with positive sizes and at most {_MAX_DEVICES} devices in all; "
            f"got {a.mesh!r}")
  hq = max(a.dim // 32, 1) if a.heads is None else a.heads
  hkv = max(hq // 2, 1) if a.kv_heads is None else a.kv_heads
  _check_sizes(p, {"--context": a.context, "--batch": a.batch, "--steps": a.steps, "--layers": a.layers,
                   "--dim": a.dim, "--heads": hq, "--kv-heads": hkv, "--vocab": a.vocab})
  if a.dim % hq or hq % hkv:
    p.error(f"need --dim a multiple of --heads and --heads a multiple of --kv-heads; got --dim {a.dim}, "
            f"--heads {hq}, --kv-heads {hkv}")
  # Two models (fdecode and reference), each with float32 weights and a cache.
  params = a.vocab * a.dim * 2 + a.layers * (4 * a.dim * a.dim + 6 * a.dim * a.dim)
  cache = 2 * a.layers * a.batch * hkv * a.context * (a.dim // hq)
  _check_memory(p, 2 * 4 * (params + cache), "the two models and their caches")
  if not 0 <= a.seed < 2**32:
    p.error(f"--seed must be in [0, 2**32), got {a.seed}")
  if a.steps > a.context:
    p.error(f"--steps must be in [1, --context={a.context}], got {a.steps}")
  cfg = ModelConfig(vocab=a.vocab, dim=a.dim, layers=a.layers, num_heads=hq, num_kv_heads=hkv,
                    head_dim=a.dim // hq, mlp_dim=2 * a.dim)
  return a, cfg, (n_heads_axis, n_seq_axis)


def generate_main(argv, prog: str = "python -m fdecode.cli.synthetic") -> int:
  a, cfg, (n_heads_axis, n_seq_axis) = _generate_args(argv, prog)
  ensure_host_devices(max(8, n_heads_axis * n_seq_axis))
  hq, hkv = cfg.num_heads, cfg.num_kv_heads
  s, b, steps = a.context, a.batch, a.steps

  # Prompts of different lengths, right-padded; the longest starts mid-cache so that the
  # sequences sit in different "seq" shards while they decode.
  max_prompt = max(1, min(s // 2, s - steps + 1))
  rng = np.random.default_rng(a.seed)
  prompts = rng.integers(0, cfg.vocab, (b, max_prompt), dtype=np.int32)
  lengths = rng.integers(max(1, max_prompt // 4), max_prompt + 1, (b,), dtype=np.int32)
  lengths[0] = max_prompt
  prompts[np.arange(max_prompt)[None, :] >= lengths[:, None]] = 0  # padding

  devices = jax.devices()
  need = n_heads_axis * n_seq_axis
  why_not = None
  if len(devices) < need:
    why_not = f"only {len(devices)} device(s), mesh {a.mesh} needs {need}"
  elif hkv % n_heads_axis and not (n_heads_axis % hkv == 0 and hq % n_heads_axis == 0):
    why_not = f"Hkv={hkv} does not split over {n_heads_axis} head shards"
  elif s % n_seq_axis:
    why_not = f"--context={s} is not a multiple of the {n_seq_axis} seq shards"
  if why_not is None:
    # jax.make_mesh's default (Explicit) axes: the cache writes keep the cache's sharding
    # and sharded_flash_decode reshards its inputs itself.
    mesh = jax.make_mesh((n_heads_axis, n_seq_axis), ("heads", "seq"), devices=devices[:need])
    decode_fn = functools.partial(fdecode.sharded_flash_decode, mesh=mesh, head_axis="heads",
                                  seq_axis="seq")
    heads = "heads" if hkv % n_heads_axis == 0 else None
    # Contiguous [B, Hkv, S, D] (and its scales) or a page pool [Hkv, P, page_size, D]:
    # kv heads over "heads", tokens (pages) over "seq".
    spec = P(heads, "seq", None, None) if CACHE_KINDS[a.cache]["page_size"] else P(None, heads, "seq", None)
    cache_sharding = NamedSharding(mesh, spec)
    where = f"mesh heads={n_heads_axis} x seq={n_seq_axis}"
  else:
    decode_fn, cache_sharding, where = fdecode.flash_decode, None, "1 device"

  print(f"fdecode generation demo on {len(devices)} {jax.default_backend()} device(s), {where}")
  if why_not:
    print(f"  FALLBACK: single-device flash_decode, not sharded_flash_decode ({why_not})")
  model = Transformer(cfg, decode_fn=decode_fn, seed=a.seed)
  n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  model.init_cache(b, s, **CACHE_KINDS[a.cache])
  cache_mib = model.cache_bytes() / 2**20
  print(f"  model: {cfg.layers} layers, E={cfg.dim}, Hq={hq}, Hkv={hkv}, D={cfg.head_dim}, "
        f"F={cfg.mlp_dim}, V={cfg.vocab}, float32, {n_params / 1e6:.2f}M random params (seed {a.seed})")
  print(f"  cache: {a.cache} k+v [B={b}, Hkv={hkv}, S={s}, D={cfg.head_dim}] x {cfg.layers} "
        f"layers = {cache_mib:.3g} MiB" + (f", sharded {cache_sharding.spec}" if cache_sharding else ""))
  print(f"  prompts: lengths {lengths.tolist()} (right-padded to {max_prompt}), {steps} new tokens each")

  gen = generate(model, prompts, lengths, steps, cache_sharding=cache_sharding,
                 on_step=progress_bar("flash"))
  ref_model = Transformer(cfg, decode_fn=functools.partial(fdecode.flash_decode, impl="reference"),
                          seed=a.seed)
  ref_model.init_cache(b, s, **CACHE_KINDS[a.cache])  # the same cache, read by the reference
  ref = generate(ref_model, prompts, lengths, steps, on_step=progress_bar("reference"))

  timed = gen.step_s[1:] or gen.step_s  # the first decode step includes compilation
  ms = statistics.median(timed) * 1e3 if timed else float("nan")
  ref_ms = statistics.median(ref.step_s[1:] or ref.step_s) * 1e3 if ref.step_s else float("nan")
  tok_s = b / (ms * 1e-3)
  first = f", first decode step (compiles) {gen.step_s[0]:.2f}s" if gen.step_s else ""
  print(f"  flash ({where}): prefill (compiles) {gen.prefill_s:.2f}s{first}; step median "
        f"{ms:.2f} ms over {len(timed)} = {tok_s:.0f} tokens/s")
  print(f"  reference (1 device): prefill {ref.prefill_s:.2f}s; step median {ref_ms:.2f} ms")
  print(f"  sequence 0 tokens: {gen.tokens[0, :16].tolist()}{' ...' if steps > 16 else ''}")

  ok, verdict = _compare(gen, ref)
  print(f"  vs reference: {verdict}")
  shape = f"{b}x{steps}"
  if ok:
    print(f"OK: generated {shape} tokens ({where}, {ms:.2f} ms/step median, {tok_s:.0f} tokens/s, "
          f"{cache_mib:.3g} MiB cache), identical to reference")
    return 0
  print(f"MISMATCH: generated {shape} tokens ({where}) differ from reference: {verdict}")
  return 1


def _compare(gen, ref) -> tuple[bool, str]:
  """Tokens must be identical; logits (up to the first divergence, where both runs saw the
  same tokens) must agree within `_LOGITS_ATOL`. Also reports the smallest top-2 margin of
  the reference logits, i.e. how close greedy decoding came to an argmax tie."""
  diverged = np.argwhere(gen.tokens != ref.tokens)
  # Steps whose inputs were identical in both runs: up to and including the first divergence.
  upto = int(diverged[:, 1].min()) + 1 if diverged.size else gen.tokens.shape[1]
  diff = float(np.abs(gen.logits[:, :upto] - ref.logits[:, :upto]).max())
  top2 = np.sort(ref.logits[:, :upto], axis=-1)[..., -2:]
  margin = top2[..., 1] - top2[..., 0]  # [B, upto]
  stats = f"max |logit diff| {diff:.2e} (tol {_LOGITS_ATOL:.0e}), smallest top-2 margin {margin.min():.2e}"
  if diverged.size:
    step = upto - 1
    seq = int(diverged[diverged[:, 1] == step][0, 0])
    tie = " (a near-tie: within the logits tolerance)" if margin[seq, step] <= _LOGITS_ATOL else ""
    return False, (f"first divergence at step {step} of sequence {seq}: token "
                   f"{int(gen.tokens[seq, step])} vs reference {int(ref.tokens[seq, step])}, reference "
                   f"top-2 margin there {margin[seq, step]:.2e}{tie}; {stats}")
  if not np.isfinite(diff) or diff > _LOGITS_ATOL:
    return False, f"tokens identical but logits disagree: {stats}"
  return True, f"tokens identical ({gen.tokens.shape[0]}x{gen.tokens.shape[1]}); {stats}"


def kernel_main(argv=None, prog: str = "python -m fdecode.cli.synthetic --kernel") -> int:
  """The single-step kernel benchmark (``--kernel``)."""
  p = argparse.ArgumentParser(prog=prog, description=_KERNEL_DOC)
  p.add_argument("--batch", type=int, default=4)
  p.add_argument("--context", type=int, default=16384, help="cache capacity S (tokens)")
  p.add_argument("--q-heads", type=int, default=32)
  p.add_argument("--kv-heads", type=int, default=8)
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
  p.add_argument("--impl", choices=["xla", "pallas", "reference"], default=None)
  p.add_argument("--iters", type=int, default=10)
  a = p.parse_args(argv)
  _check_sizes(p, {"--batch": a.batch, "--context": a.context, "--q-heads": a.q_heads,
                   "--kv-heads": a.kv_heads, "--head-dim": a.head_dim, "--iters": a.iters})
  if a.q_heads % a.kv_heads:
    p.error(f"--q-heads must be a multiple of --kv-heads; got {a.q_heads} and {a.kv_heads}")
  dtype = jnp.dtype(a.dtype)
  # q, k, v and the float32 reference's copies of them.
  _check_memory(p, (dtype.itemsize + 4) * a.batch * a.head_dim * (a.q_heads + 2 * a.kv_heads * a.context),
                "q, k and v (and the reference's float32 copies)")
  kq, kk, kv, kl = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(kq, (a.batch, a.q_heads, a.head_dim), dtype)
  k = jax.random.normal(kk, (a.batch, a.kv_heads, a.context, a.head_dim), dtype)
  v = jax.random.normal(kv, (a.batch, a.kv_heads, a.context, a.head_dim), dtype)
  # Sequences at different positions, the longest filling the cache.
  lengths = jax.random.randint(kl, (a.batch,), a.context // 2, a.context + 1).at[0].set(a.context)
  impl = a.impl or ("xla" if jax.default_backend() == "cpu" else "pallas")
  kv_bytes = 2 * k.size * k.dtype.itemsize
  print(f"fdecode demo on {jax.devices()[0].device_kind} ({jax.default_backend()}): impl={impl}")
  print(f"  q {q.shape} {a.dtype}, cache k/v {k.shape} ({kv_bytes / 2**20:.0f} MiB), "
        f"lengths {np.asarray(lengths).tolist()}")

  step = jax.jit(lambda q, k, v, n: fdecode.flash_decode(q, k, v, n, impl=impl, return_lse=True))
  t0 = time.perf_counter()
  out, lse = jax.block_until_ready(step(q, k, v, lengths))
  compile_s = time.perf_counter() - t0
  times = []
  for _ in range(a.iters):
    t0 = time.perf_counter()
    jax.block_until_ready(step(q, k, v, lengths))
    times.append(time.perf_counter() - t0)
  ms = statistics.median(times) * 1e3

  ref, ref_lse = fdecode.flash_decode(q, k, v, lengths, impl="reference", return_lse=True)
  err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
  lse_err = float(jnp.max(jnp.abs(lse - ref_lse)))
  tol = 2.5e-2 if dtype == jnp.bfloat16 else 3e-5
  ok = err <= tol and bool(jnp.all(jnp.isfinite(out)))
  print(f"  out {out.shape} {out.dtype}; first values {np.asarray(out[0, 0, :4], np.float32).round(4).tolist()}")
  print(f"  compile {compile_s:.2f}s; step median {ms:.2f} ms over {a.iters} runs "
        f"= {kv_bytes / (ms * 1e-3) / 1e9:.1f} GB/s of KV")
  print(f"  vs float32 reference: max |out diff| {err:.2e} (tol {tol:.0e}), max |lse diff| {lse_err:.2e}")
  print(f"{'OK' if ok else 'MISMATCH'}: decoded {a.batch}x{a.q_heads} heads over {a.context} tokens "
        f"in {ms:.2f} ms ({impl}, {a.dtype})")
  return 0 if ok else 1


if __name__ == "__main__":
  raise SystemExit(main())
