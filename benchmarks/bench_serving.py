"""Continuous batching (`fdecode.serving.Engine`) against `generate`, Gemma 3 270M, one run.

The workload is `scripts/demo --serve 16`'s: 16 requests cycling through the demo's 4
prompts, request i arriving at engine step i, ``--max-new-tokens`` each (stopping early
at EOS, as the demo does). Contenders, each after a warm-up that compiles everything it
uses (compile time reported apart), timed on the same model in the same process:

  * engine, request i at step i (the demo's workload) with token-count buckets;
  * engine, all 16 at once (the batch fills at once: the steady state);
  * engine, one bucket = the whole token budget (every step runs 128 rows: before buckets);
  * generate, batch 4 (`scripts/demo` without --serve): the 4 prompts as one batch;
  * generate, each request alone (batch 1): the 16 requests one after another.

tokens/s = generated tokens / seconds of the steps that made them (prefill included).
Then the per-step table of the demo's workload (the bucket each step ran over), each
bucket's median step and compile time, a step with one live decode against a batch-1
`generate` step, every served request checked against generating it alone, and the
compilations counted (at most one per bucket; none in a timed run).

  python benchmarks/bench_serving.py          # Gemma 3 270M (needs the demo extra's weights)
  python benchmarks/bench_serving.py --quick  # a tiny random-weight Gemma 3, seconds (the test suite runs this)
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import statistics

import numpy as np

from _records import add_json_arg, machine_line, record, write  # benchmarks/ is on sys.path

from fdecode.serving import Engine, Request, token_buckets


BENCH = "bench_serving"


def load(quick: bool):
  """(model, prompts as id lists, eos_id, what) for the full run or --quick."""
  if quick:
    from fdecode.models.gemma3 import Gemma3, Gemma3Config  # pylint: disable=import-outside-toplevel
    cfg = Gemma3Config(vocab=96, dim=32, layers=2, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64,
                       window=16, global_every=2)
    rng = np.random.default_rng(0)
    return Gemma3(cfg, seed=0), [rng.integers(0, 96, n).tolist() for n in (3, 9, 11, 2)], None, "tiny Gemma 3"
  from fdecode.cli.demo import DEFAULT_PROMPTS  # pylint: disable=import-outside-toplevel
  from fdecode.models import GGUFTokenizer, gemma3_270m_path, load_gemma3  # pylint: disable=import-outside-toplevel
  model, f = load_gemma3(gemma3_270m_path())
  tok = GGUFTokenizer(f.metadata)
  return model, [tok.encode(t) for t in DEFAULT_PROMPTS], tok.eos_id, "Gemma 3 270M (float32 weights)"


@contextlib.contextmanager
def counting_compiles():
  """Names of the functions JAX compiles while inside (its "Compiling <name>" DEBUG record,
  as tests/test_recompile.py counts them)."""
  names, log = [], logging.getLogger("jax._src.interpreters.pxla")
  handler, level = logging.Handler(logging.DEBUG), log.level
  handler.emit = lambda r: names.append(str(r.args[0])) if r.msg.startswith("Compiling %s") else None
  log.addHandler(handler)
  log.setLevel(logging.DEBUG)
  try:
    yield names
  finally:
    log.removeHandler(handler)
    log.setLevel(level)


def upto_eos(tokens, eos_id):
  tokens = list(tokens)
  return tokens[:tokens.index(eos_id) + 1] if eos_id is not None and eos_id in tokens else tokens


def serve(model, prompts, n, steps, *, arrivals, eos_id, budget, buckets=None):
  """One engine run: (engine, {request: tokens}, which prompt each request is, compilations)."""
  max_len = -(-(max(map(len, prompts)) + steps) // 16) * 16
  engine = Engine(model, max_seqs=min(n, 16, budget), token_budget=budget, max_len=max_len, page_size=16,
                  eos_id=eos_id, buckets=buckets)
  which = [i % len(prompts) for i in range(n)]
  ids = [engine.submit(Request(prompts[w], steps, arrival=i if arrivals else 0)) for i, w in enumerate(which)]
  with counting_compiles() as names:
    done = engine.run()
  return engine, [done[i].tokens for i in ids], which, names.count("jit(_serve_step)")


def generate_run(model, prompts, steps):
  """`generate` over ``prompts`` as one batch: (Generation, tokens made, seconds of its steps)."""
  from fdecode.generate import generate  # pylint: disable=import-outside-toplevel
  b, longest = len(prompts), max(map(len, prompts))
  padded = np.zeros((b, longest), np.int32)
  for i, p in enumerate(prompts):
    padded[i, :len(p)] = p
  model.init_cache(b, -(-(longest + steps) // 64) * 64)
  out = generate(model, padded, np.array([len(p) for p in prompts], np.int32), steps)
  return out, b * steps, out.prefill_s + sum(out.step_s)


def timed_generate(model, prompts, steps):
  """Warm-up, then the timed run: (Generation, tokens, seconds, compile seconds)."""
  _, _, warm = generate_run(model, prompts, steps)
  out, tokens, seconds = generate_run(model, prompts, steps)
  return out, tokens, seconds, max(warm - seconds, 0.0)


def engine_rows(model, prompts, a, eos_id):
  """The engine's contenders, each a warm-up run then a timed one on a fresh engine:
  {name: dict(timed=engine, tokens, which, warm=engine, compilations=(warm-up, timed))}."""
  runs = {}
  for name, arrivals, buckets in (("engine, request i at step i (buckets)", True, None),
                                  ("engine, all at once (buckets)", False, None),
                                  (f"engine, request i at step i, one bucket of {a.budget} rows", True, (a.budget,))):
    go = lambda: serve(model, prompts, a.serve, a.steps, arrivals=arrivals, eos_id=eos_id, budget=a.budget,
                       buckets=buckets)
    warm, timed = go(), go()
    runs[name] = dict(timed=timed[0], tokens=timed[1], which=timed[2], warm=warm[0], compilations=(warm[3], timed[3]))
  return runs


def one_decode_ms(model, prompt, a):
  """Median ms of an engine step holding one live decode (one request served alone), warm."""
  for _ in range(2):  # the first run compiles
    engine, *_ = serve(model, [prompt], 1, a.steps, arrivals=False, eos_id=None, budget=a.budget)
  ms = [s.seconds * 1e3 for s in engine.history if s.decodes == 1 and s.prefill_tokens == 0]
  return statistics.median(ms), len(ms)


def print_steps(engine):
  print("\n### Steps of the demo's workload (request i arrives at step i), timed run\n")
  print("| step | decodes | prefill tokens | running | bucket N / M | ms |")
  print("|---:|---:|---:|---:|---:|---:|")
  for s in engine.history:
    print(f"| {s.step} | {s.decodes} | {s.prefill_tokens} | {s.running} | {s.rows} / {s.seqs} | {s.seconds * 1e3:.1f} |")


def bucket_rows(timed, warm):
  """[(N, M, steps, median ms, compile s)] of the timed run's buckets. Compile s: the
  warm-up's first step over the bucket (it compiled it) minus the bucket's median step."""
  out = []
  for n in sorted({s.rows for s in timed.history}):
    med = statistics.median(s.seconds * 1e3 for s in timed.history if s.rows == n)
    first = next(s.seconds for s in warm.history if s.rows == n)
    out.append((n, min(n, timed.max_seqs), sum(s.rows == n for s in timed.history), med, max(first - med / 1e3, 0.0)))
  return out


def throughput(runs, gen4, alone, which, eos_id, rec):
  """The throughput table; returns (records, tokens/s of the demo's workload, batch-4
  generate's, whether every served request equals generating it alone)."""
  base = gen4[1] / gen4[2]
  ref = {w: upto_eos(alone[w][0].tokens[0], eos_id) for w in alone}
  print("\n### Throughput after compilation (compile apart)\n")
  print("| contender | tokens | seconds | tokens/s | x batch-4 generate | median step ms | compile s | compilations |")
  print("|---|---:|---:|---:|---:|---:|---:|---:|")
  records, identical, rates = [], True, []

  def row(name, tokens, seconds, step_ms, compile_s, compilations):
    rates.append(tokens / seconds)
    print(f"| {name} | {tokens} | {seconds:.2f} | {tokens / seconds:.1f} | {tokens / seconds / base:.2f} | "
          f"{step_ms:.1f} | {compile_s:.1f} | {compilations} |")
    records.append(rec(name, step_ms, section="throughput", tokens=tokens, run_s=seconds,
                       tokens_per_s=tokens / seconds, compile_s=compile_s, compilations=compilations))

  for name, r in runs.items():
    identical &= all(t == ref[w] for t, w in zip(r["tokens"], r["which"]))
    timed_s = sum(s.seconds for s in r["timed"].history)
    row(name, sum(map(len, r["tokens"])), timed_s, statistics.median(s.seconds * 1e3 for s in r["timed"].history),
        max(sum(s.seconds for s in r["warm"].history) - timed_s, 0.0), "%d + %d" % r["compilations"])
  row("generate, batch 4 (the demo)", gen4[1], gen4[2], statistics.median(gen4[0].step_s) * 1e3, gen4[3], "-")
  row("generate, each request alone (batch 1)", sum(alone[w][1] for w in which), sum(alone[w][2] for w in which),
      statistics.median(x for w in which for x in alone[w][0].step_s) * 1e3,
      sum(x[3] for x in alone.values()), "-")
  return records, rates[0], base, identical


def main(argv=None):
  """Prints the tables; records carry ``section`` ("throughput" / "buckets" / "targets"),
  ``tokens_per_s``, ``tokens``, ``run_s``, ``compile_s``, ``compilations``; the per-step table
  of the demo's workload is the file's top-level ``steps``."""
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--quick", action="store_true", help="a tiny random-weight Gemma 3")
  p.add_argument("--serve", type=int, default=16, help="requests (default 16)")
  p.add_argument("--max-new-tokens", dest="steps", type=int, default=16, help="new tokens per request (default 16)")
  p.add_argument("--budget", type=int, default=128, help="engine token budget (default 128, as the demo)")
  add_json_arg(p, BENCH)
  a = p.parse_args(argv)
  if a.quick:
    a.budget, a.steps = min(a.budget, 4), min(a.steps, 5)
  machine = machine_line()
  model, prompts, eos_id, what = load(a.quick)
  print(f"# fdecode serving benchmark: {what}, {a.serve} requests of {a.steps} new tokens\n\nmachine: {machine}")
  print(f"prompts: {[len(x) for x in prompts]} tokens; engine: {min(a.serve, 16, a.budget)} sequences, {a.budget} tokens "
        f"per step, pages of 16; buckets {token_buckets(a.budget)}")
  runs = engine_rows(model, prompts, a, eos_id)
  gen4 = timed_generate(model, prompts, a.steps)
  which = [i % len(prompts) for i in range(a.serve)]
  alone = {w: timed_generate(model, [prompts[w]], a.steps) for w in sorted(set(which))}
  shape = dict(requests=a.serve, new_tokens=a.steps, budget=a.budget, max_seqs=min(a.serve, 16, a.budget))
  rec = lambda name, ms, **kw: record(BENCH, name, shape=shape, dtype="float32", seconds=ms and ms / 1e3,
                                      nbytes=None, floor_seconds=None, machine=machine, **kw)
  records, serve_tps, base, identical = throughput(runs, gen4, alone, which, eos_id, rec)
  demo = next(iter(runs.values()))
  print_steps(demo["timed"])
  print("\n### Buckets of the demo's workload (timed run; compile s from the warm-up run)\n")
  print("| bucket N (token rows) | M (sequence rows) | steps | median ms | compile s |")
  print("|---:|---:|---:|---:|---:|")
  for n, m, count, med, comp in bucket_rows(demo["timed"], demo["warm"]):
    print(f"| {n} | {m} | {count} | {med:.1f} | {comp:.1f} |")
    records.append(rec(f"bucket N={n} M={m}", med, section="buckets", steps=count, compile_s=comp))
  one_ms, count = one_decode_ms(model, prompts[0], a)
  gen1_ms = statistics.median(x for v in alone.values() for x in v[0].step_s) * 1e3
  print("\n## Targets\n")
  print(f"- demo workload / batch-4 generate tokens/s: {serve_tps / base:.2f}x (target >= 3)")
  print(f"- a step with one live decode: {one_ms:.1f} ms (median of {count}) / batch-1 generate step "
        f"{gen1_ms:.1f} ms = {one_ms / gen1_ms:.2f}x (target <= 1.3)")
  print(f"- served tokens identical to generating each request alone: {'yes' if identical else 'NO'}")
  print("- compilations of the engine's step (warm-up + timed run, buckets used): " + "; ".join(
      f"{name}: %d + %d ({len({s.rows for s in r['timed'].history})})" % r["compilations"] for name, r in runs.items()))
  records.append(rec("one live decode step", one_ms, section="targets", batch1_generate_ms=gen1_ms,
                     ratio=one_ms / gen1_ms))
  records.append(rec("demo workload over batch-4 generate", None, section="targets", ratio=serve_tps / base,
                     identical=identical))
  steps = [dict(step=s.step, decodes=s.decodes, prefill_tokens=s.prefill_tokens, running=s.running, rows=s.rows,
                seqs=s.seqs, ms=s.seconds * 1e3) for s in demo["timed"].history]
  write(a.json, BENCH, records, machine=machine, argv=argv, steps=steps,
        generate_ms=dict(batch4=statistics.median(gen4[0].step_s) * 1e3, batch1=gen1_ms))
  return 0 if identical else 1


if __name__ == "__main__":
  raise SystemExit(main())
