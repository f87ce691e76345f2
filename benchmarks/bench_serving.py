"""Continuous batching (`fdecode.decoding.serving.Engine`) against `generate`, Gemma 3 270M, one run.

The workload is `scripts/demo --serve 16`'s: 16 requests cycling through the demo's 4
prompts, request i arriving at engine step i, ``--max-new-tokens`` each (stopping early
at EOS, as the demo does). Contenders, on the same model in the same process:

  * engine, request i at step i (the demo's workload), token-count buckets;
  * engine, all at once: the 16 requests arrive together (the batch is full at once);
  * engine, request i at step i, one bucket of the whole budget (every step runs 128
    rows, as before buckets);
  * generate, batch 4 (`scripts/demo` without --serve): the 4 prompts as one batch;
  * generate, each request alone (batch 1): each distinct prompt generated alone, its
    time counted once for every request that uses it (16 requests, one after another).

Each contender runs once to compile (its warm-up; compile time = that run minus a timed
one), then ``--rounds`` timed rounds, every contender once per round in a rotating order
(so a change of the machine's load falls on all of them). tokens/s = generated tokens /
seconds of the steps that made them (prefill included), the median over the rounds.

Also: a step with one live decode (an engine serving one request) against a batch-1
`generate` decode step; the per-step table of the demo's workload with the bucket each
step ran over; each bucket's median step and compile time; every served request checked
against generating it alone; the engine's step compilations counted (at most one per
bucket in the warm-up, none in a timed round).

  python benchmarks/bench_serving.py          # Gemma 3 270M (needs the demo extra's weights)
  python benchmarks/bench_serving.py --quick  # a tiny random-weight Gemma 3, seconds (the test suite runs this)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import statistics

import numpy as np

from _records import add_json_arg, machine_line, record, write  # benchmarks/ is on sys.path
from fdecode.decoding.serving import Engine, Request, token_buckets

BENCH = "bench_serving"


@dataclasses.dataclass
class Run:
  """One timed run of a contender."""

  tokens: int          # generated tokens
  seconds: float       # seconds of the steps that made them
  step_ms: list        # each step's ms (generate: the decode steps)
  outputs: list        # each request's tokens, in request order
  which: list          # each request's prompt
  engine: Engine | None = None
  compiles: int = 0    # compilations of the engine's step during the run


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
  as tests/api/test_recompile.py counts them)."""
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


def serve(model, prompts, which, steps, *, arrivals, eos_id, budget, max_seqs, buckets=None) -> Run:
  """Requests ``prompts[w] for w in which`` through a fresh engine (as scripts/demo --serve)."""
  max_len = -(-(max(map(len, prompts)) + steps) // 16) * 16
  engine = Engine(model, max_seqs=max_seqs, token_budget=budget, max_len=max_len, page_size=16, eos_id=eos_id,
                  buckets=buckets)
  ids = [engine.submit(Request(prompts[w], steps, arrival=i if arrivals else 0)) for i, w in enumerate(which)]
  with counting_compiles() as names:
    done = engine.run()
  outputs = [done[i].tokens for i in ids]
  return Run(sum(map(len, outputs)), sum(s.seconds for s in engine.history),
             [s.seconds * 1e3 for s in engine.history], outputs, list(which), engine, names.count("jit(_serve_step)"))


def generate_batch(model, prompts, steps, eos_id) -> Run:
  """`generate` over ``prompts`` as one batch (right-padded, contiguous cache)."""
  from fdecode.decoding.generate import generate  # pylint: disable=import-outside-toplevel
  b, longest = len(prompts), max(map(len, prompts))
  padded = np.zeros((b, longest), np.int32)
  for i, p in enumerate(prompts):
    padded[i, :len(p)] = p
  model.init_cache(b, -(-(longest + steps) // 64) * 64)
  out = generate(model, padded, np.array([len(p) for p in prompts], np.int32), steps)
  return Run(b * steps, out.prefill_s + sum(out.step_s), [s * 1e3 for s in out.step_s],
             [upto_eos(t, eos_id) for t in out.tokens], list(range(b)))


def generate_alone(model, prompts, which, steps, eos_id) -> Run:
  """Each distinct prompt generated alone (batch 1), counted for every request using it."""
  runs = {w: generate_batch(model, [prompts[w]], steps, eos_id) for w in sorted(set(which))}
  return Run(sum(runs[w].tokens for w in which), sum(runs[w].seconds for w in which),
             [ms for r in runs.values() for ms in r.step_ms], [runs[w].outputs[0] for w in which], list(which))


def contenders(model, prompts, which, a, eos_id) -> dict:
  """{name: () -> Run}: the throughput contenders, then the one-live-decode engine."""
  max_seqs = min(a.serve, 16, a.budget)  # the demo's engine, for every engine contender
  go = lambda arrivals, buckets=None, ws=which: lambda: serve(
      model, prompts, ws, a.steps, arrivals=arrivals, eos_id=eos_id, budget=a.budget, max_seqs=max_seqs,
      buckets=buckets)
  return {"engine, request i at step i (buckets)": go(True),
          "engine, all at once (buckets)": go(False),
          f"engine, request i at step i, one bucket of {a.budget} rows": go(True, (a.budget,)),
          "generate, batch 4 (the demo)": lambda: generate_batch(model, prompts, a.steps, eos_id),
          "generate, each request alone (batch 1)": lambda: generate_alone(model, prompts, which, a.steps, eos_id),
          "one request alone through the engine": go(False, None, [0])}  # the same engine, one request


def measure(fns: dict, rounds: int):
  """(warm-up run of each, [round: {name: Run}]), the order rotating each round."""
  warm = {name: fn() for name, fn in fns.items()}
  names, out = list(fns), []
  for r in range(rounds):
    order = names[r % len(names):] + names[:r % len(names)]
    got = {name: fns[name]() for name in order}
    out.append({name: got[name] for name in names})
  return warm, out


def throughput_table(warm, rounds, rec):
  """Prints the table; returns (records, {name: median tokens/s})."""
  names = [n for n in warm if not n.startswith("one request")]
  tps = {n: statistics.median(r[n].tokens / r[n].seconds for r in rounds) for n in names}
  base = tps["generate, batch 4 (the demo)"]
  print(f"\n### Throughput after compilation: median of {len(rounds)} rounds (min-max), compile apart\n")
  print("| contender | tokens | tokens/s | range | x batch-4 generate | median step ms | compile s | compilations |")
  print("|---|---:|---:|---:|---:|---:|---:|---:|")
  records = []
  for n in names:
    runs = [r[n] for r in rounds]
    rates = [x.tokens / x.seconds for x in runs]
    step_ms = statistics.median(ms for x in runs for ms in x.step_ms)
    compile_s = max(warm[n].seconds - statistics.median(x.seconds for x in runs), 0.0)
    comp = f"{warm[n].compiles} + {sum(x.compiles for x in runs)}" if warm[n].engine else "-"
    print(f"| {n} | {runs[0].tokens} | {tps[n]:.1f} | {min(rates):.1f}-{max(rates):.1f} | {tps[n] / base:.2f} | "
          f"{step_ms:.1f} | {compile_s:.1f} | {comp} |")
    records.append(rec(n, step_ms, section="throughput", tokens=runs[0].tokens, tokens_per_s=tps[n],
                       tokens_per_s_range=[min(rates), max(rates)], x_batch4=tps[n] / base, compile_s=compile_s,
                       compilations=comp))
  return records, tps


def bucket_table(warm: Run, rounds: list, rec):
  """Per-step table of the last round and per-bucket medians over every round's steps."""
  last = rounds[-1].engine
  print("\n### Steps of the demo's workload (request i arrives at step i), last round\n")
  print("| step | decodes | prefill tokens | running | bucket N / M | ms |")
  print("|---:|---:|---:|---:|---:|---:|")
  for s in last.history:
    print(f"| {s.step} | {s.decodes} | {s.prefill_tokens} | {s.running} | {s.rows} / {s.seqs} | "
          f"{s.seconds * 1e3:.1f} |")
  print(f"\n### Buckets of the demo's workload: steps over all {len(rounds)} rounds; compile s = the warm-up's "
        "first step over the bucket minus the bucket's median\n")
  print("| bucket N (token rows) | M (sequence rows) | steps | median ms | ms per live token | compile s |")
  print("|---:|---:|---:|---:|---:|---:|")
  records = []
  for n in sorted({s.rows for s in last.history}):
    steps = [s for r in rounds for s in r.engine.history if s.rows == n]
    med = statistics.median(s.seconds * 1e3 for s in steps)
    per_token = statistics.median(s.seconds * 1e3 / (s.decodes + s.prefill_tokens) for s in steps)
    first = next(s.seconds for s in warm.engine.history if s.rows == n)
    comp = max(first - med / 1e3, 0.0)
    print(f"| {n} | {steps[0].seqs} | {len(steps)} | {med:.1f} | {per_token:.1f} | {comp:.1f} |")
    records.append(rec(f"bucket N={n} M={steps[0].seqs}", med, section="buckets", steps=len(steps),
                       ms_per_token=per_token, compile_s=comp))
  return records


def main(argv=None):
  """Prints the tables; records carry ``section`` ("throughput" / "buckets" / "targets"),
  ``tokens_per_s`` (median over rounds), ``x_batch4``, ``compile_s``, ``compilations``; the
  last round's per-step table of the demo's workload is the file's top-level ``steps``."""
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--quick", action="store_true", help="a tiny random-weight Gemma 3")
  p.add_argument("--serve", type=int, default=16, help="requests (default 16)")
  p.add_argument("--max-new-tokens", dest="steps", type=int, default=16, help="new tokens per request (default 16)")
  p.add_argument("--budget", type=int, default=128, help="engine token budget (default 128, as the demo)")
  p.add_argument("--rounds", type=int, default=3, help="timed rounds of every contender (default 3)")
  add_json_arg(p, BENCH)
  a = p.parse_args(argv)
  if a.quick:
    a.budget, a.steps, a.rounds = min(a.budget, 4), min(a.steps, 5), min(a.rounds, 2)
  machine = machine_line()
  model, prompts, eos_id, what = load(a.quick)
  which = [i % len(prompts) for i in range(a.serve)]
  print(f"# fdecode serving benchmark: {what}, {a.serve} requests of {a.steps} new tokens\n\nmachine: {machine}")
  print(f"prompts: {[len(x) for x in prompts]} tokens; engine: {min(a.serve, 16, a.budget)} sequences, {a.budget} "
        f"tokens per step, pages of 16; buckets {token_buckets(a.budget)}")
  warm, rounds = measure(contenders(model, prompts, which, a, eos_id), a.rounds)
  shape = dict(requests=a.serve, new_tokens=a.steps, budget=a.budget, max_seqs=min(a.serve, 16, a.budget))
  rec = lambda name, ms, **kw: record(BENCH, name, shape=shape, dtype="float32", seconds=ms and ms / 1e3,
                                      nbytes=None, floor_seconds=None, machine=machine, **kw)
  records, tps = throughput_table(warm, rounds, rec)
  demo_name = next(iter(warm))
  records += bucket_table(warm[demo_name], [r[demo_name] for r in rounds], rec)
  alone = "generate, each request alone (batch 1)"
  ref = dict(zip(rounds[-1][alone].which, rounds[-1][alone].outputs))
  identical = all(out == ref[w] for r in rounds for x in r.values() if x.engine for out, w in zip(x.outputs, x.which))
  one = [ms for r in rounds for ms, s in zip(r["one request alone through the engine"].step_ms,
                                             r["one request alone through the engine"].engine.history)
         if s.decodes == 1 and s.prefill_tokens == 0]
  one_ms, gen1_ms = statistics.median(one), statistics.median(ms for r in rounds for ms in r[alone].step_ms)
  gen4_ms = statistics.median(ms for r in rounds for ms in r["generate, batch 4 (the demo)"].step_ms)
  ratio = tps[demo_name] / tps["generate, batch 4 (the demo)"]
  print("\n## Targets\n")
  print(f"- demo workload / batch-4 generate tokens/s: {ratio:.2f}x (target >= 3)")
  print(f"- a step with one live decode: {one_ms:.1f} ms (median of {len(one)}) / batch-1 generate decode step "
        f"{gen1_ms:.1f} ms = {one_ms / gen1_ms:.2f}x (target <= 1.3)")
  print(f"- served tokens identical to generating each request alone: {'yes' if identical else 'NO'}")
  used = len({s.rows for r in rounds for s in r[demo_name].engine.history})
  print(f"- the demo workload's step compiled {warm[demo_name].compiles} times in its warm-up ({used} buckets used) "
        f"and {sum(r[demo_name].compiles for r in rounds)} times in {len(rounds)} timed rounds")
  records.append(rec("one live decode step", one_ms, section="targets", batch1_generate_ms=gen1_ms,
                     ratio=one_ms / gen1_ms))
  records.append(rec("demo workload over batch-4 generate", None, section="targets", ratio=ratio, identical=identical))
  steps = [dict(step=s.step, decodes=s.decodes, prefill_tokens=s.prefill_tokens, running=s.running, rows=s.rows,
                seqs=s.seqs, ms=s.seconds * 1e3) for s in rounds[-1][demo_name].engine.history]
  write(a.json, BENCH, records, machine=machine, argv=argv, steps=steps,
        generate_ms=dict(batch4=gen4_ms, batch1=gen1_ms))
  return 0 if identical else 1


if __name__ == "__main__":
  raise SystemExit(main())
