"""Validates fdecode's Gemma 3 against llama.cpp (``llama-cpp-python``) on the same GGUF.

An oracle nobody here wrote: llama.cpp runs the Gemma 3 270M Q4_K_M file with its own
graph (``src/models/gemma3.cpp``) and quantized kernels; fdecode runs `fdecode.models.Gemma3`
with the weights dequantized to float32. Both get the same token ids (fdecode's tokenizer;
llama.cpp's own tokenization is compared and reported) and decode greedily. Per prompt it
reports the agreement length, and at the first divergence both models' top-2 margins and
the margin each gives its own choice over the other's (a near tie on both sides means the
quantized arithmetic, not the model, decided). Then it times one decode step (batch 1) of
both at several context lengths.

Not part of CI or any extra: ``pip install llama-cpp-python`` (builds from source, ~10 min
on 2 cores), then ``python benchmarks/validate_llama_cpp.py [--gguf PATH]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

PROMPTS = (
    "The capital of France is",
    "Here is a simple Python function that returns the n-th Fibonacci number:\n\ndef fibonacci(n):",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "clockmaker who",
    "Water boils at",
    "The three laws of motion formulated by Isaac Newton are",
    "1, 2, 3, 5, 8, 13, 21,",
)


def _top2(logits):
  i = np.argsort(logits)[-2:][::-1]
  return int(i[0]), float(logits[i[0]] - logits[i[1]])


def llama_generate(llm, ids, steps):
  """Greedy tokens and their logits [steps, V] from llama.cpp, starting from ``ids``."""
  n_vocab = llm.n_vocab()
  llm.reset()
  tokens, logits = [], []
  feed = list(ids)
  for _ in range(steps):
    llm.eval(feed)
    row = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,)).copy()  # pylint: disable=protected-access
    logits.append(row)
    tokens.append(int(np.argmax(row)))
    feed = [tokens[-1]]
  return np.asarray(tokens), np.stack(logits)


def compare_prompt(text, ids, f_tok, f_log, l_tok, l_log):
  steps = len(f_tok)
  agree = next((i for i in range(steps) if f_tok[i] != l_tok[i]), steps)
  line = f"  agree {agree}/{steps}"
  common = slice(0, min(agree + 1, steps))
  diff = np.abs(f_log[common] - l_log[common])
  if agree < steps:
    i, a, b = agree, int(f_tok[agree]), int(l_tok[agree])
    _, fm = _top2(f_log[i])
    _, lm = _top2(l_log[i])
    line += (f"; first divergence at step {i}: fdecode {a} vs llama.cpp {b}; top-2 margins "
             f"fdecode {fm:.3f}, llama.cpp {lm:.3f}; fdecode prefers its token by "
             f"{f_log[i, a] - f_log[i, b]:.3f}, llama.cpp its own by {l_log[i, b] - l_log[i, a]:.3f}")
  line += f"; |logit diff| up to there: max {diff.max():.3f}, mean {diff.mean():.3f}"
  return agree, line


def time_decode(model, llm, context, reps, rng):
  """At ``context`` cached tokens (random ids: past the 512-token window, so the local
  layers' masking shows): one decode step's ms (batch 1) of fdecode and llama.cpp, and a
  comparison of their logits after the prefill. Returns (fdecode ms, llama.cpp ms, text)."""
  from fdecode.decoding.generate import generate  # pylint: disable=import-outside-toplevel
  ids = np.concatenate([[2], rng.integers(1000, 200000, context - 1)]).astype(np.int32)
  model.init_cache(1, -(-(context + reps + 2) // 64) * 64)
  gen = generate(model, ids[None], np.asarray([context]), reps + 2)
  f_ms = statistics.median(gen.step_s[1:]) * 1e3  # the first step compiles
  llm.reset()
  llm.eval(ids.tolist())
  l_log = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).copy()  # pylint: disable=protected-access
  f_log = gen.logits[0, 0]
  (ft, fm), (lt, lm), d = _top2(f_log), _top2(l_log), f_log - l_log
  check = (f"after the prefill: argmax {'same' if ft == lt else f'DIFFERS ({ft} vs {lt})'}, top-2 margins "
           f"{fm:.3f} / {lm:.3f}, |logit diff| max {np.abs(f_log - l_log).max():.3f} "
           f"mean {np.abs(f_log - l_log).mean():.3f}, mean after removing the mean offset "
           f"(softmax ignores it) {np.abs(d - d.mean()).mean():.3f}")
  times, tok = [], int(np.argmax(l_log))
  for _ in range(reps + 1):
    t0 = time.perf_counter()
    llm.eval([tok])
    times.append(time.perf_counter() - t0)
  return f_ms, statistics.median(times[1:]) * 1e3, check


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--gguf", default=None, help="GGUF file (default: the PyPI Gemma 3 270M package)")
  p.add_argument("--max-new-tokens", type=int, default=32)
  p.add_argument("--contexts", default="128,512,2048", help="context lengths to time (comma-separated)")
  p.add_argument("--reps", type=int, default=8, help="timed decode steps per context")
  p.add_argument("--threads", type=int, default=os.cpu_count())
  p.add_argument("--skip-generation", action="store_true", help="only the timings")
  a = p.parse_args(argv)
  try:
    from llama_cpp import Llama  # pylint: disable=import-outside-toplevel
  except ImportError:
    print("llama-cpp-python is not installed: pip install llama-cpp-python", file=sys.stderr)
    return 2
  import jax  # pylint: disable=import-outside-toplevel
  from fdecode.decoding.generate import generate  # pylint: disable=import-outside-toplevel
  from fdecode.models import GGUFTokenizer, gemma3_270m_path, load_gemma3  # pylint: disable=import-outside-toplevel

  path = str(a.gguf or gemma3_270m_path())
  contexts = [int(c) for c in a.contexts.split(",") if c]
  model, f = load_gemma3(path)
  tok = GGUFTokenizer(f.metadata)
  n_ctx = max(contexts + [256]) + 64
  llm = Llama(model_path=path, n_ctx=n_ctx, n_batch=512, n_threads=a.threads, verbose=False)
  print(f"fdecode vs llama.cpp on {os.path.basename(path)} (jax {jax.__version__}, "
        f"{jax.default_backend()}; llama.cpp {a.threads} threads); greedy, {a.max_new_tokens} tokens")

  ids = [tok.encode(t) for t in PROMPTS]
  for t, x in zip(PROMPTS, ids):
    theirs = llm.tokenize(t.encode("utf-8"), add_bos=True, special=False)
    if list(theirs) != x:
      print(f"  NOTE tokenization differs for {t[:30]!r}: fdecode {x} vs llama.cpp {list(theirs)}")
  rng = np.random.default_rng(0)
  if a.skip_generation:
    ids = []
  b, longest, steps = len(ids), max(map(len, ids), default=0), a.max_new_tokens
  prompts = np.zeros((b, longest), np.int32)
  for i, x in enumerate(ids):
    prompts[i, :len(x)] = x
  total = 0
  if b:
    model.init_cache(b, -(-(longest + steps) // 64) * 64)
    gen = generate(model, prompts, np.asarray([len(x) for x in ids]), steps)
  for i, (text, x) in enumerate(zip(PROMPTS, ids)):
    l_tok, l_log = llama_generate(llm, x, steps)
    agree, line = compare_prompt(text, x, gen.tokens[i], gen.logits[i], l_tok, l_log)
    total += agree
    print(f"prompt {i} ({len(x)} tokens) {text[:40]!r}")
    print(f"  fdecode:   {tok.decode(gen.tokens[i])!r}")
    print(f"  llama.cpp: {tok.decode(l_tok)!r}")
    print(line)
  if b:
    print(f"agreement: {total}/{b * steps} tokens before the first divergence of each prompt")
  print("decode step, batch 1 (median of", a.reps, "steps, one run):")
  for c in contexts:
    f_ms, l_ms, check = time_decode(model, llm, c, a.reps, rng)
    print(f"  context {c:5d}: fdecode {f_ms:8.1f} ms/token   llama.cpp {l_ms:8.1f} ms/token; {check}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
