"""The benchmark runs end to end (tiny shapes) and reports every contender with a number."""

import json
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCHEMA = {"bench", "contender", "shape", "dtype", "median_ms", "gb_per_s", "floor_fraction", "machine"}


def records(path, bench):
  """The records of a results file (benchmarks/_records.py), each checked against the schema."""
  doc = json.loads(path.read_text())
  assert doc["bench"] == bench and doc["machine"] and doc["command"].startswith(f"python benchmarks/{bench}.py")
  for r in doc["records"]:
    assert SCHEMA <= set(r), r
    assert r["bench"] == bench and r["machine"] == doc["machine"] and isinstance(r["shape"], dict), r
    for key in ("median_ms", "gb_per_s", "floor_fraction"):
      assert r[key] is None or r[key] > 0, r
  return doc["records"]


def test_bench_decode_quick_reports_every_contender(tmp_path):
  out = subprocess.run([sys.executable, "benchmarks/bench_decode.py", "--quick", "--iters", "2",
                        "--json", str(tmp_path / "d.json")],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, check=True).stdout
  for row in ("floor: read K, V", "fdecode default (xla)", "jax.nn.dot_product_attention",
              "fdecode pallas (interpret)", "jax pallas gqa (interpret)", "paged f32, page 16 (xla)",
              "int8 per-token (xla)"):
    assert re.search(rf"\| {re.escape(row)} \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \|", out), (row, out)
  assert re.search(r"paged / contiguous time: [\d.]+x; int8 speed-up over f32 cache: [\d.]+x", out)
  recs = records(tmp_path / "d.json", "bench_decode")
  sweep = [(r["dtype"], r["shape"]["S"]) for r in recs if r["section"] == "sweep" and r["contender"] == "fdecode default (xla)"]
  assert sweep == [("float32", 256), ("float32", 512), ("bfloat16", 256), ("bfloat16", 512)], sweep
  assert {r["format"] for r in recs if r["section"] == "formats"} == {"contiguous", "paged16", "int8"}
  assert all(r["median_ms"] and r["floor_fraction"] for r in recs), recs


def test_bench_gpu_builds_its_tables_on_cpu(tmp_path):
  """bench_gpu's whole table-building path with tiny shapes on CPU: fdecode (interpret mode),
  floors and the XLA peer get numbers; the GPU-only peers read "n/a (needs GPU)"."""
  subprocess.run([sys.executable, "benchmarks/bench_gpu.py", "--out", str(tmp_path), "--batches", "1",
                  "--seqs", "128", "--heads", "4,2", "--head-dim", "64", "--iters", "1", "--inner", "1"],
                 cwd=ROOT, capture_output=True, text=True, timeout=300, check=True)
  md = (tmp_path / "bench_gpu.md").read_text()
  number = r"[\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \| (?:\d+|n/a)"
  for fmt, row in [("contiguous", "floor: read K, V (bf16)"), ("contiguous", "fdecode pallas"),
                   ("token-major", "dot_product_attention (xla)"), ("paged16", "fdecode pallas, paged (page 16)"),
                   ("paged64", "fdecode pallas, paged (page 64)"), ("int8", "floor: read K, V, scales (int8)"),
                   ("int8", "fdecode pallas, int8 cache"), ("fp8", "fdecode pallas, fp8 cache")]:
    assert re.search(rf"\| {fmt} \| {re.escape(row)} \| {number} \|", md), (row, md)
  gpu_only = {"jax pallas gqa kernel (head-major)", "dot_product_attention (cudnn)",
              "jax pallas gqa (public API, swaps inside)", "torch sdpa", "torch sdpa (cuda graph)"}
  for row in gpu_only:
    assert re.search(rf"\| {re.escape(row)} \| n/a \| n/a \| n/a \| n/a \| n/a \| n/a \(needs GPU\) \|", md), (row, md)
  # The kernel count comes from the compiled program, on CPU too (interpret mode runs XLA loops).
  assert re.search(r"\| contiguous \| fdecode pallas \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \| \d+ \|", md), md
  assert "## Targets (recorded, not asserted)" in md
  assert re.search(r"\| <= 2 kernels per decode call \| worst [\d.]+ \(B=1 S=128 Hq=4 Hkv=2 D=64\) \| n/a \(not on GPU\) \|", md), md
  rows = json.loads((tmp_path / "bench_gpu.json").read_text())["rows"]
  assert len(rows) == 15 and all(r["b"] == 1 and r["s"] == 128 for r in rows)
  recs = records(tmp_path / "bench_gpu.json", "bench_gpu")
  assert [r["contender"] for r in recs] == [r["name"] for r in rows]
  assert {r["contender"] for r in recs if r["median_ms"] is None} == gpu_only


def test_bench_variants_quick_reports_every_row(tmp_path):
  out = subprocess.run([sys.executable, "benchmarks/bench_variants.py", "--quick", "--iters", "1",
                        "--json", str(tmp_path / "v.json")],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, check=True).stdout
  for row in ("floor: read K, V", "plain", "mask [B, S]", "mask [B, 1, Hq, S] (per head)", "bias [B, S]",
              "alibi_slopes [Hq]", "window=256", "logits_soft_cap=30", "sinks [Hq]", "all of them"):
    assert re.search(rf"\| {re.escape(row)} \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \|", out), (row, out)
  # The windowed decode reads the window's blocks only: as many as plain decode over the window.
  blocks = {name: int(n) for name, n in re.findall(
      r"\| (plain S=256|window=256, S=4096|plain S=4096) \|.*\| (\d+) \(128, \d+\) \|", out)}
  assert blocks["window=256, S=4096"] == blocks["plain S=256"] < blocks["plain S=4096"], out
  recs = records(tmp_path / "v.json", "bench_variants")
  assert [r["section"] for r in recs] == ["overhead"] * 12 + ["window"] * 3
  assert next(r for r in recs if r["contender"] == "plain")["time_over_plain"] == 1.0
  assert {r["contender"]: r["pallas_blocks"] for r in recs if r["section"] == "window"} == blocks


def test_bench_cascade_quick_reports_every_contender(tmp_path):
  out = subprocess.run([sys.executable, "benchmarks/bench_cascade.py", "--quick", "--iters", "1",
                        "--json", str(tmp_path / "c.json")],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, check=True).stdout
  for row in ("floor: read prefix once + suffixes", "cascade_decode (default impl)", "floor: read 4 full copies",
              "flash_decode over 4 full copies (default impl)"):
    assert re.search(rf"\| {re.escape(row)} \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \|", out), (row, out)
  diff = re.search(r"cascade speed-up over full copies: [\d.]+x; bytes read: [\d.]+x fewer; "
                   r"max \|cascade - full\| = ([\d.e-]+)", out)
  assert diff and float(diff.group(1)) < 2e-2, out  # the same attention, bf16 rounding apart
  recs = records(tmp_path / "c.json", "bench_cascade")
  assert len(recs) == 4 and recs[1]["shape"] == dict(B=4, Sp=512, Ss=32, Hkv=2, Hq=8, D=64), recs


def test_bench_mla_sparse_quick_reports_every_row(tmp_path):
  out = subprocess.run([sys.executable, "benchmarks/bench_mla_sparse.py", "--quick", "--iters", "1",
                        "--json", str(tmp_path / "m.json")],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, check=True).stdout
  for row in ("floor: read the bf16 latent cache once", "flash_decode v=None (one read)",
              "flash_decode with a value copy k[..., :Dv]", "flash_decode fp8 latent (FlashMLA layout)",
              "dense decode, S=256", "sparse decode, S=4096, K=256 (indices [B, K])", "dense decode, S=4096"):
    assert re.search(rf"\| {re.escape(row)} \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \|", out), (row, out)
  assert re.search(r"sparse over S=4096 \(K=256\) / dense over S=256: [\d.]+x", out), out
  recs = records(tmp_path / "m.json", "bench_mla_sparse")
  assert [r["section"] for r in recs] == ["mla"] * 6 + ["sparse"] * 5, recs


def test_bench_sharding_writes_records(tmp_path):
  subprocess.run([sys.executable, "benchmarks/bench_sharding.py", "--context", "256", "--iters", "1",
                  "--json", str(tmp_path / "s.json")], cwd=ROOT, capture_output=True, text=True, timeout=600, check=True)
  recs = records(tmp_path / "s.json", "bench_sharding")
  assert [(r["section"], r["devices"]) for r in recs] == [
      ("collectives", 2), ("collectives", 8), ("step time", 1), ("step time", 2), ("step time", 8)]
  assert all(r["median_ms"] is None and sum(r["collective_bytes"].values()) > 0 for r in recs[:2])


def test_bench_ragged_quick_reports_every_contender(tmp_path):
  out = subprocess.run([sys.executable, "benchmarks/bench_ragged.py", "--quick", "--iters", "1",
                        "--json", str(tmp_path / "r.json")],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, check=True).stdout
  for row in ("floor: read live K+V once", "ragged_decode (one call)", "ragged_decode + fused write (donated pools)",
              "ragged_decode, NHD pool (one call)",
              "ragged_decode, contiguous cache (one call)", "flash_decode: decodes + chunk, two calls", "flash_decode padded to T=64",
              "ragged_decode (B decodes)", "flash_decode (T=1)"):
    assert re.search(rf"\| {re.escape(row)} \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \|", out), (row, out)
  diff = re.search(r"max \|ragged - two calls\| = ([\d.e-]+)", out)
  assert diff and float(diff.group(1)) < 2e-2, out  # the same attention, bf16 rounding apart
  recs = records(tmp_path / "r.json", "bench_ragged")
  assert {r["section"] for r in recs} == {"mixed", "decode"} and len(recs) == 10, recs


def test_bench_serving_quick_reports_every_contender(tmp_path):
  """A tiny random-weight Gemma 3: every contender gets tokens/s, each step its bucket,
  served tokens equal generating each request alone, and no timed round compiles."""
  out = subprocess.run([sys.executable, "benchmarks/bench_serving.py", "--quick", "--serve", "6",
                        "--json", str(tmp_path / "s.json")],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, check=True).stdout
  number = r"[\d.]+ \| [\d.]+-[\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+"
  for row, compiles in (("engine, request i at step i (buckets)", r"[123] \+ 0"),
                        ("engine, all at once (buckets)", r"\d \+ 0"),
                        ("engine, request i at step i, one bucket of 4 rows", r"\d \+ 0"),
                        ("generate, batch 4 (the demo)", "-"), ("generate, each request alone (batch 1)", "-")):
    assert re.search(rf"\| {re.escape(row)} \| \d+ \| {number} \| {compiles} \|", out), (row, out)
  assert "served tokens identical to generating each request alone: yes" in out
  used = re.search(r"step compiled (\d+) times in its warm-up \((\d+) buckets used\) and 0 times in 2 timed rounds",
                   out)
  assert used and used.group(1) == used.group(2), out  # one compilation per bucket (1, 2, 4), none later
  assert re.search(r"a step with one live decode: [\d.]+ ms \(median of \d+\) / batch-1 generate decode step", out)
  recs = records(tmp_path / "s.json", "bench_serving")
  assert [r["section"] for r in recs if r["section"] != "buckets"] == ["throughput"] * 5 + ["targets"] * 2
  buckets = {r["contender"] for r in recs if r["section"] == "buckets"}
  assert buckets <= {"bucket N=1 M=1", "bucket N=2 M=2", "bucket N=4 M=4"}, buckets
  steps = json.loads((tmp_path / "s.json").read_text())["steps"]
  assert steps and all(s["rows"] in (1, 2, 4) and s["decodes"] + s["prefill_tokens"] <= s["rows"] for s in steps)
