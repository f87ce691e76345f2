"""The benchmark runs end to end (tiny shapes) and reports every contender with a number.

The reports are read as tables of cells and "name: value" lines (`cells`, `numbers`,
`value_after`): what is asserted is which contenders appear and that their numbers are
finite, not the column widths or order of the printout."""

import json
import math
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


def cells(text, *labels):
  """The cells after ``labels`` (consecutive cells) in the first table row of ``text`` that has
  them; fails naming the row if none has."""
  for line in text.splitlines():
    if not line.lstrip().startswith("|"):
      continue
    row = [c.strip() for c in line.strip().strip("|").split("|")]
    for i in range(len(row) - len(labels) + 1):
      if tuple(row[i:i + len(labels)]) == labels:
        return row[i + len(labels):]
  raise AssertionError(f"no row {labels} in:\n{text}")


def finite(cell):
  """A cell's leading number, which must be finite (a timing, a ratio, a count)."""
  m = re.match(r"[-+]?(\d+\.?\d*|\.\d+)(e[-+]?\d+)?", cell.strip())
  assert m, f"not a number: {cell!r}"
  x = float(m.group(0))
  assert math.isfinite(x), cell
  return x


def numbers(text, *labels, n):
  """The first ``n`` cells of a contender's row, each a finite number."""
  row = cells(text, *labels)
  assert len(row) >= n, (labels, row)
  return [finite(c) for c in row[:n]]


def value_after(text, phrase):
  """The finite number right after ``phrase`` in a report line."""
  i = text.find(phrase)
  assert i >= 0, f"{phrase!r} not in:\n{text}"
  return finite(text[i + len(phrase):].lstrip())


def test_bench_decode_quick_reports_every_contender(tmp_path):
  out = subprocess.run([sys.executable, "benchmarks/bench_decode.py", "--quick", "--iters", "2",
                        "--json", str(tmp_path / "d.json")],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, check=True).stdout
  for row in ("floor: read K, V", "fdecode default (xla)", "jax.nn.dot_product_attention",
              "fdecode pallas (interpret)", "jax pallas gqa (interpret)", "paged f32, page 16 (xla)",
              "int8 per-token (xla)"):
    numbers(out, row, n=4)
  assert value_after(out, "paged / contiguous time:") > 0
  assert value_after(out, "int8 speed-up over f32 cache:") > 0
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
  for fmt, row in [("contiguous", "floor: read K, V (bf16)"), ("contiguous", "fdecode pallas"),
                   ("token-major", "dot_product_attention (xla)"), ("paged16", "fdecode pallas, paged (page 16)"),
                   ("paged64", "fdecode pallas, paged (page 64)"), ("int8", "floor: read K, V, scales (int8)"),
                   ("int8", "fdecode pallas, int8 cache"), ("fp8", "fdecode pallas, fp8 cache")]:
    numbers(md, fmt, row, n=4)
    kernels = cells(md, fmt, row)[4]
    assert kernels == "n/a" or finite(kernels) >= 1, (row, kernels)
  gpu_only = {"jax pallas gqa kernel (head-major)", "dot_product_attention (cudnn)",
              "jax pallas gqa (public API, swaps inside)", "torch sdpa", "torch sdpa (cuda graph)"}
  for row in gpu_only:
    row_cells = cells(md, row)
    assert row_cells and all(c.startswith("n/a") for c in row_cells) and "needs GPU" in " ".join(row_cells), (row, md)
  # The kernel count comes from the compiled program, on CPU too (interpret mode runs XLA loops).
  assert finite(cells(md, "contiguous", "fdecode pallas")[4]) >= 1, md
  assert re.search(r"^#+ Targets", md, flags=re.M), md
  worst, on_gpu = cells(md, "<= 2 kernels per decode call")[:2]
  assert worst.startswith("worst") and value_after(worst, "worst") >= 1 and "B=1 S=128 Hq=4 Hkv=2 D=64" in worst, md
  assert on_gpu.startswith("n/a"), md
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
    numbers(out, row, n=5)
  # The windowed decode reads the window's blocks only: as many as plain decode over the window.
  blocks = {}
  for name in ("plain S=256", "window=256, S=4096", "plain S=4096"):  # the block count: "N (128, k)"
    blocks[name] = int(next(finite(c) for c in cells(out, name) if re.fullmatch(r"\d+ \(128, \d+\)", c)))
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
    numbers(out, row, n=5)
  assert value_after(out, "cascade speed-up over full copies:") > 0
  assert value_after(out, "bytes read:") > 0
  assert value_after(out, "max |cascade - full| =") < 2e-2, out  # the same attention, bf16 rounding apart
  recs = records(tmp_path / "c.json", "bench_cascade")
  assert len(recs) == 4 and recs[1]["shape"] == dict(B=4, Sp=512, Ss=32, Hkv=2, Hq=8, D=64), recs


def test_bench_mla_sparse_quick_reports_every_row(tmp_path):
  out = subprocess.run([sys.executable, "benchmarks/bench_mla_sparse.py", "--quick", "--iters", "1",
                        "--json", str(tmp_path / "m.json")],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, check=True).stdout
  for row in ("floor: read the bf16 latent cache once", "flash_decode v=None (one read)",
              "flash_decode with a value copy k[..., :Dv]", "flash_decode fp8 latent (FlashMLA layout)",
              "dense decode, S=256", "sparse decode, S=4096, K=256 (indices [B, K])", "dense decode, S=4096"):
    numbers(out, row, n=5)
  assert value_after(out, "sparse over S=4096 (K=256) / dense over S=256:") > 0, out
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
    numbers(out, row, n=5)
  assert value_after(out, "max |ragged - two calls| =") < 2e-2, out  # the same attention, bf16 rounding apart
  recs = records(tmp_path / "r.json", "bench_ragged")
  assert {r["section"] for r in recs} == {"mixed", "decode"} and len(recs) == 10, recs


def test_bench_serving_quick_reports_every_contender(tmp_path):
  """A tiny random-weight Gemma 3: every contender gets tokens/s, each step its bucket,
  served tokens equal generating each request alone, and no timed round compiles."""
  out = subprocess.run([sys.executable, "benchmarks/bench_serving.py", "--quick", "--serve", "6",
                        "--json", str(tmp_path / "s.json")],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, check=True).stdout
  for row, warmup in (("engine, request i at step i (buckets)", {1, 2, 3}), ("engine, all at once (buckets)", None),
                      ("engine, request i at step i, one bucket of 4 rows", None),
                      ("generate, batch 4 (the demo)", "-"), ("generate, each request alone (batch 1)", "-")):
    # requests, tokens/s, its range (low-high), three timings; then the compiles
    row_cells = cells(out, row)
    numbers(out, row, n=6)
    low, high = row_cells[2].split("-")
    assert finite(low) <= finite(high), (row, row_cells)
    compiles = row_cells[6]
    if warmup == "-":
      assert compiles == "-", (row, compiles)
    else:  # "<warm-up> + <timed rounds>": nothing compiles once warm
      first, timed = (c.strip() for c in compiles.split("+"))
      assert finite(timed) == 0 and (warmup is None or finite(first) in warmup), (row, compiles)
  assert "served tokens identical to generating each request alone: yes" in out
  used = re.search(r"step compiled (\d+) times in its warm-up \((\d+) buckets used\) and 0 times in 2 timed rounds",
                   out)
  assert used and used.group(1) == used.group(2), out  # one compilation per bucket (1, 2, 4), none later
  assert value_after(out, "a step with one live decode:") > 0, out
  recs = records(tmp_path / "s.json", "bench_serving")
  assert [r["section"] for r in recs if r["section"] != "buckets"] == ["throughput"] * 5 + ["targets"] * 2
  buckets = {r["contender"] for r in recs if r["section"] == "buckets"}
  assert buckets <= {"bucket N=1 M=1", "bucket N=2 M=2", "bucket N=4 M=4"}, buckets
  steps = json.loads((tmp_path / "s.json").read_text())["steps"]
  assert steps and all(s["rows"] in (1, 2, 4) and s["decodes"] + s["prefill_tokens"] <= s["rows"] for s in steps)


def test_bench_grad_quick_reports_every_contender(tmp_path):
  out = subprocess.run([sys.executable, "benchmarks/bench_grad.py", "--quick", "--iters", "1",
                        "--json", str(tmp_path / "g.json")],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, check=True).stdout
  for row in ("floor: read K+V once", "forward: flash_decode", "grad: fdecode (flash_decode)",
              "grad: plain autodiff of the XLA path", "grad: jax.nn.dot_product_attention"):
    numbers(out, row, n=4)
  recs = records(tmp_path / "g.json", "bench_grad")
  assert len(recs) == 10 and all(r["temp_bytes"] >= 0 for r in recs), recs


def test_bench_invariant_quick_reports_both_paths(tmp_path):
  out = subprocess.run([sys.executable, "benchmarks/bench_invariant.py", "--quick", "--iters", "1",
                        "--json", str(tmp_path / "i.json")],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, check=True).stdout
  rows = [l for l in out.splitlines() if re.match(r"\| \d+ \| \d+ \| \d+ \|", l)]
  cells_of = lambda line: [float(c) for c in line.strip().strip("|").split("|")]
  assert len(rows) == 2 and all(len(cells_of(l)) == 7 and all(math.isfinite(x) and x > 0 for x in cells_of(l))
                                for l in rows), out
  recs = records(tmp_path / "i.json", "bench_invariant")
  assert len(recs) == 6 and all(r["median_ms"] > 0 for r in recs), recs
