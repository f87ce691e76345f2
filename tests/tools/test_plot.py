"""benchmarks/plot.py turns small JSON results into PNG figures (each decodes and has something
drawn on it); no pixel compare, and no figure size pinned."""

import json
import pathlib
import subprocess
import sys

import numpy as np
from PIL import Image  # pillow: a dependency of matplotlib, which plot.py draws with

ROOT = pathlib.Path(__file__).resolve().parents[2]
MACHINE = "test machine, 2 cores, backend cpu (cpu), jax 0"
# The figures plot.py draws from a full set of results.
EXPECTED = {"decode_floor_fraction.png", "cache_formats.png", "modifiers.png", "compile_report.png",
            "gpu_floor_fraction.png", "gpu_cache_formats.png", "mla_sparse.png", "cascade.png", "ragged.png",
            "serving.png"}
GPU_ONLY = ("gpu_floor_fraction.png", "gpu_cache_formats.png")


def rec(bench, contender, ms, frac, *, dtype="bfloat16", **shape_and_extra):
  shape = {k: shape_and_extra.pop(k) for k in list(shape_and_extra) if k[0].isupper()}
  return dict(bench=bench, contender=contender, shape=shape, dtype=dtype, median_ms=ms,
              gb_per_s=None if ms is None else 1.0 / ms, floor_fraction=frac, machine=MACHINE, **shape_and_extra)


def write(directory, bench, records, **fields):
  doc = dict(bench=bench, machine=MACHINE, command=f"python benchmarks/{bench}.py --quick", date="2026-01-01T00:00",
             records=records, **fields)
  (directory / f"{bench}.json").write_text(json.dumps(doc))


def decode_records():
  out = []
  for dtype in ("float32", "bfloat16"):
    for s in (256, 1024, 4096):
      for name, ms in (("floor: read K, V", 1.0), ("fdecode default (xla)", 2.0),
                       ("jax.nn.dot_product_attention", 8.0)):
        out.append(rec("bench_decode", name, ms * s / 256, 1.0 / ms, dtype=dtype, section="sweep",
                       B=2, S=s, Hkv=2, Hq=8, D=64))
  for name, fmt, ms, frac in (("floor f32: read K, V", "contiguous", 1.0, 1.0),
                              ("contiguous f32 (xla)", "contiguous", 2.0, 0.5),
                              ("paged f32, page 16 (xla)", "paged16", 3.0, 0.33),
                              ("floor int8: read K8, V8, scales", "int8", 0.3, 1.0),
                              ("int8 per-token (xla)", "int8", 1.0, 0.3)):
    out.append(rec("bench_decode", name, ms, frac, dtype="int8" if fmt == "int8" else "float32",
                   section="formats", format=fmt, B=2, S=512, Hkv=2, Hq=8, D=64))
  return out


def gpu_records():
  out = []
  for b in (1, 8):
    for s in (4096, 32768):
      for name, fmt, ms in (("floor: read K, V (bf16)", "contiguous", 1.0), ("fdecode pallas", "contiguous", 1.2),
                            ("jax pallas gqa kernel (head-major)", "contiguous", 1.5),
                            ("dot_product_attention (cudnn)", "token-major", None),  # refused: n/a
                            ("dot_product_attention (xla)", "token-major", 4.0),
                            ("fdecode pallas, paged (page 16)", "paged16", 1.3), ("fdecode pallas, int8 cache", "int8", 0.7),
                            ("fdecode pallas, fp8 cache", "fp8", 0.7)):
        out.append(rec("bench_gpu", name, ms, ms and 1.0 / ms, format=fmt, B=b, S=s, Hq=32, Hkv=8, D=128))
  return out


def compile_records():
  out = []
  for chip in ("h100", "a100"):
    for case, programs in (("bf16 B=1 S=32k", 1584), ("int8 B=8 S=32k", 768)):
      out.append(rec("compile_report", "fdecode " + case.split()[0], None, 0.9, chip=chip, case=case, predicted=True,
                     programs=programs, one_wave=396, waves=programs / 396, B=1, S=32768, Hkv=8, Hq=32, D=128))
  out.append(rec("compile_report", "fdecode bf16", None, None, chip="v5e", case="bf16 B=1 S=32k", compiles=True,
                 B=1, S=32768, Hkv=8, Hq=32, D=128))  # TPU: not in the figure
  return out


def run_plot(src, out):
  return subprocess.run([sys.executable, "benchmarks/plot.py", "--in", str(src), "--out", str(out)],
                        cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)


def assert_figure(path):
  """``path`` is a PNG that decodes to an image with something drawn on it (not one flat colour)."""
  with Image.open(path) as image:
    assert image.format == "PNG", path
    pixels = np.asarray(image.convert("RGB"))
  assert pixels.shape[0] > 0 and pixels.shape[1] > 0, path
  assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 1, f"{path}: a blank image"


def test_plot_writes_every_figure(tmp_path):
  src, out = tmp_path / "results", tmp_path / "plots"
  src.mkdir()
  write(src, "bench_decode", decode_records())
  write(src, "bench_gpu", gpu_records())
  write(src, "compile_report", compile_records())
  write(src, "bench_variants", [rec("bench_variants", name, ms, 0.1 / ms, section="overhead", B=2, S=1024, Hkv=2, Hq=8, D=64)
                                for name, ms in (("floor: read K, V", 0.1), ("plain", 1.0), ("mask [B, S]", 1.1),
                                                 ("window=256", 0.5))])
  write(src, "bench_mla_sparse", [rec("bench_mla_sparse", name, 1.0, frac, section=section, B=2, S=512)
                                  for section, name, frac in (("mla", "floor: read the latent", 1.0),
                                                              ("mla", "flash_decode v=None (one read)", 0.4),
                                                              ("sparse", "sparse decode, S=4096, K=256", 0.3))])
  write(src, "bench_cascade", [rec("bench_cascade", name, ms, frac, B=4, Sp=512, Ss=32)
                               for name, ms, frac in (("floor: read prefix once + suffixes", 0.1, 1.0),
                                                      ("cascade_decode (default impl)", 0.3, 0.33))])
  write(src, "bench_ragged", [rec("bench_ragged", name, ms, 6.0 / ms, section=section, B=64, L=4096, C=512)
                              for section, name, ms in (("mixed", "floor: read live K+V once", 6.0),
                                                        ("mixed", "ragged_decode (one call)", 280.0),
                                                        ("mixed", "flash_decode padded to T=512", 9900.0),
                                                        ("decodes", "ragged_decode (B decodes)", 230.0))])
  write(src, "bench_serving", [rec("bench_serving", name, ms, None, dtype="float32", section="throughput",
                                   tokens_per_s=tps, requests=16)
                               for name, ms, tps in (("engine, request i at step i (buckets)", 60.0, 40.0),
                                                     ("generate, batch 4 (the demo)", 90.0, 12.0))],
        steps=[dict(step=i, decodes=i, prefill_tokens=0, running=i, rows=r, seqs=min(r, 16), ms=20.0 + i)
               for i, r in enumerate((1, 2, 4, 4, 8, 16, 32))], generate_ms=dict(batch4=90.0, batch1=60.0))
  log = run_plot(src, out).stderr
  assert {p.name for p in out.iterdir()} == EXPECTED, log
  for name in sorted(EXPECTED):
    assert_figure(out / name)


def test_plot_skips_missing_results(tmp_path):
  """scripts/gpu_check's case: a directory with only bench_gpu.json gives the GPU figures."""
  write(tmp_path, "bench_gpu", gpu_records())
  log = run_plot(tmp_path, tmp_path).stderr
  assert sorted(p.name for p in tmp_path.glob("*.png")) == sorted(GPU_ONLY), log
  assert "decode_floor_fraction.png: skipped, no" in log
  for name in GPU_ONLY:
    assert_figure(tmp_path / name)
