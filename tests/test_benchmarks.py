"""The benchmark runs end to end (tiny shapes) and reports every contender with a number."""

import json
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


def test_bench_gpu_builds_its_tables_on_cpu(tmp_path):
  """bench_gpu's whole table-building path with tiny shapes on CPU: fdecode (interpret mode),
  floors and the XLA peer get numbers; the GPU-only peers read "n/a (needs GPU)"."""
  subprocess.run([sys.executable, "benchmarks/bench_gpu.py", "--out", str(tmp_path), "--batches", "1",
                  "--seqs", "128", "--heads", "4,2", "--head-dim", "64", "--iters", "1", "--inner", "1"],
                 cwd=ROOT, capture_output=True, text=True, timeout=300, check=True)
  md = (tmp_path / "bench_gpu.md").read_text()
  number = r"[\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+"
  for fmt, row in [("contiguous", "floor: read K, V (bf16)"), ("contiguous", "fdecode pallas"),
                   ("token-major", "dot_product_attention (xla)"), ("paged16", "fdecode pallas, paged (page 16)"),
                   ("paged64", "fdecode pallas, paged (page 64)"), ("int8", "floor: read K, V, scales (int8)"),
                   ("int8", "fdecode pallas, int8 cache"), ("fp8", "fdecode pallas, fp8 cache")]:
    assert re.search(rf"\| {fmt} \| {re.escape(row)} \| {number} \|", md), (row, md)
  for row in ("jax pallas gqa kernel (head-major)", "dot_product_attention (cudnn)",
              "jax pallas gqa (public API, swaps inside)"):
    assert re.search(rf"\| {re.escape(row)} \| n/a \| n/a \| n/a \| n/a \| n/a \(needs GPU\) \|", md), (row, md)
  assert "## Targets (recorded, not asserted)" in md
  assert re.search(r"\| paged within 1\.1x of contiguous \| worst [\d.]+ \(B=1 S=128\) \| n/a \(not on GPU\) \|", md)
  rows = json.loads((tmp_path / "bench_gpu.json").read_text())["rows"]
  assert len(rows) == 12 and all(r["b"] == 1 and r["s"] == 128 for r in rows)


def test_bench_variants_quick_reports_every_row():
  out = subprocess.run([sys.executable, "benchmarks/bench_variants.py", "--quick", "--iters", "1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, check=True).stdout
  for row in ("floor: read K, V", "plain", "mask [B, S]", "mask [B, 1, Hq, S] (per head)", "bias [B, S]",
              "alibi_slopes [Hq]", "window=256", "logits_soft_cap=30", "sinks [Hq]", "all of them"):
    assert re.search(rf"\| {re.escape(row)} \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \|", out), (row, out)
  # The windowed decode reads the window's blocks only: as many as plain decode over the window.
  blocks = {name: int(n) for name, n in re.findall(
      r"\| (plain S=256|window=256, S=4096|plain S=4096) \|.*\| (\d+) \(128, \d+\) \|", out)}
  assert blocks["window=256, S=4096"] == blocks["plain S=256"] < blocks["plain S=4096"], out


def test_bench_cascade_quick_reports_every_contender():
  out = subprocess.run([sys.executable, "benchmarks/bench_cascade.py", "--quick", "--iters", "1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, check=True).stdout
  for row in ("floor: read prefix once + suffixes", "cascade_decode (default impl)", "floor: read 4 full copies",
              "flash_decode over 4 full copies (default impl)"):
    assert re.search(rf"\| {re.escape(row)} \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \|", out), (row, out)
  diff = re.search(r"cascade speed-up over full copies: [\d.]+x; bytes read: [\d.]+x fewer; "
                   r"max \|cascade - full\| = ([\d.e-]+)", out)
  assert diff and float(diff.group(1)) < 2e-2, out  # the same attention, bf16 rounding apart


def test_bench_mla_sparse_quick_reports_every_row():
  out = subprocess.run([sys.executable, "benchmarks/bench_mla_sparse.py", "--quick", "--iters", "1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, check=True).stdout
  for row in ("floor: read the bf16 latent cache once", "flash_decode v=None (one read)",
              "flash_decode with a value copy k[..., :Dv]", "flash_decode fp8 latent (FlashMLA layout)",
              "dense decode, S=256", "sparse decode, S=4096, K=256 (indices [B, K])", "dense decode, S=4096"):
    assert re.search(rf"\| {re.escape(row)} \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \|", out), (row, out)
  assert re.search(r"sparse over S=4096 \(K=256\) / dense over S=256: [\d.]+x", out), out
