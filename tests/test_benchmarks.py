"""The benchmark runs end to end (tiny shapes) and reports every contender with a number."""

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_bench_decode_quick_reports_every_contender():
  out = subprocess.run([sys.executable, "benchmarks/bench_decode.py", "--quick", "--iters", "2"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, check=True).stdout
  for row in ("floor: read K, V", "fdecode default (xla)", "jax.nn.dot_product_attention",
              "fdecode pallas (interpret)", "jax pallas gqa (interpret)", "paged f32, page 16 (xla)",
              "int8 per-token (xla)"):
    assert re.search(rf"\| {re.escape(row)} \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \|", out), (row, out)
  assert re.search(r"paged / contiguous time: [\d.]+x; int8 speed-up over f32 cache: [\d.]+x", out)
