"""Figures from the benchmarks' JSON results (benchmarks/_records.py) as PNGs.

  python benchmarks/plot.py                      # benchmarks/results/*.json -> benchmarks/plots/
  python benchmarks/plot.py --in DIR --out DIR   # e.g. scripts/gpu_check's output directory

Needs matplotlib (the ``bench`` extra, also in ``test``); draws with the Agg backend, no
display. Each figure is made when its JSON file is in ``--in``; a missing file skips its
figures with a line on stderr (not an error), so a directory holding only bench_gpu.json
gives the GPU figures. Every PNG is SIZES[name] pixels (FIGSIZE x DPI fixed, no tight
bounding box), titled with what it shows and the run's machine line, a footer with the
command and date, axes with units, and one colour per contender (COLOURS) in every figure.

  decode_floor_fraction.png  bench_decode.json "sweep": fraction of the memory floor vs S,
                             one line per contender; float32 | bfloat16 panels (the headline)
  cache_formats.png          bench_decode.json "formats": fdecode's speed on each cache format
                             relative to the contiguous cache (bars)
  modifiers.png              bench_variants.json "overhead": each score modifier's time / plain decode
  compile_report.png         compile_report.json, GPU chips: programs / one wave per benchmark
                             shape and chip, and the predicted fraction of the roofline
  gpu_floor_fraction.png     bench_gpu.json: the headline figure on a GPU (one panel per B, bf16)
  gpu_cache_formats.png      bench_gpu.json: cache formats relative to contiguous, per (B, S)
  mla_sparse.png, cascade.png  bench_mla_sparse.json, bench_cascade.json: fraction of each
                             contender's own floor
  ragged.png                 bench_ragged.json: median time per contender (log scale), per
                             section, and its ratio to the one ragged_decode call
  serving.png                bench_serving.json: tokens/s per contender (x batch-4 generate),
                             and the demo workload's step times coloured by bucket
Not drawn: pages in use over time (`scripts/demo --serve` prints them).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import textwrap

from _records import load  # benchmarks/ is on sys.path when a script here runs

HERE = pathlib.Path(__file__).resolve().parent
DPI = 100
SIZES = {"decode_floor_fraction.png": (800, 500), "cache_formats.png": (800, 500), "modifiers.png": (800, 500),
         "compile_report.png": (1000, 600), "gpu_floor_fraction.png": (1000, 500),
         "gpu_cache_formats.png": (800, 500), "mla_sparse.png": (1000, 500), "cascade.png": (800, 500),
         "ragged.png": (1100, 500), "serving.png": (1100, 500)}
# One colour per contender (and cache format, chip), matched in order: the first pattern the
# name contains wins. Floors grey; fdecode blue; peers warm; 8-bit and paged formats apart.
COLOURS = (("floor", "#7f7f7f"), ("reference", "#8c564b"), ("page 64", "#c5b0d5"), ("paged64", "#c5b0d5"),
           ("page", "#9467bd"), ("int8", "#e377c2"), ("fp8", "#bcbd22"), ("cudnn", "#d62728"),
           ("dot_product_attention", "#ff7f0e"), ("public api", "#98df8a"), ("gqa", "#2ca02c"),
           ("value copy", "#aec7e8"), ("full copies", "#aec7e8"), ("dense decode", "#aec7e8"),
           ("one bucket", "#ffbb78"), ("all at once", "#17becf"), ("engine", "#1f77b4"), ("batch 4", "#ff7f0e"),
           ("alone", "#aec7e8"),
           ("fdecode pallas", "#17becf"), ("padded", "#ffbb78"), ("two calls", "#aec7e8"), ("nhd", "#c49c94"),
           ("h100", "#76b900"), ("a100", "#3a5f0b"), ("fdecode", "#1f77b4"), ("contiguous", "#1f77b4"),
           ("cascade", "#1f77b4"), ("flash_decode", "#1f77b4"), ("decode", "#1f77b4"))


def colour(name: str) -> str:
  """The colour of a contender, cache format or chip (COLOURS; black if none matches)."""
  name = name.lower()
  return next((c for pattern, c in COLOURS if pattern in name), "#000000")


def _plt():
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


def _shape(shape, drop=()):
  return " ".join(f"{k}={v}" for k, v in shape.items() if k not in drop)


def _figure(name, ncols=1, **kw):
  w, h = SIZES[name]
  fig, axes = _plt().subplots(1, ncols, figsize=(w / DPI, h / DPI), dpi=DPI, squeeze=False, **kw)
  return fig, list(axes[0])


def _finish(fig, path, title, doc):
  """Title (with the machine line), footer (command, date), layout, PNG of exactly SIZES[name]."""
  machine = "\n".join(textwrap.wrap("machine: " + doc.get("machine", "?"), 120))
  fig.suptitle(f"{title}\n{machine}", fontsize=9)
  fig.text(0.01, 0.01, f"{doc.get('command', '')}  ({doc.get('date', '')})", fontsize=7, color="#555555")
  fig.tight_layout(rect=(0, 0.03, 1, 1))
  fig.savefig(path, dpi=DPI)
  _plt().close(fig)


def _sweep_panels(fig_name, path, doc, records, panel_key, title, panel_label):
  """Fraction of the floor vs S, one line per non-floor contender, a panel per panel_key(r)."""
  panels = list(dict.fromkeys(panel_key(r) for r in records))
  if not panels:
    return False
  fig, axes = _figure(fig_name, len(panels), sharey=True)
  for ax, panel in zip(axes, panels):
    rows = [r for r in records if panel_key(r) == panel]
    for name in dict.fromkeys(r["contender"] for r in rows if not r["contender"].startswith("floor")):
      pts = sorted((r["shape"]["S"], r["floor_fraction"]) for r in rows
                   if r["contender"] == name and r["floor_fraction"] is not None)
      if pts:
        ax.plot(*zip(*pts), marker="o", color=colour(name), label=name)
    seqs = sorted({r["shape"]["S"] for r in rows})
    ax.axhline(1.0, color=colour("floor"), linestyle="--", linewidth=1, label="floor: one read of the same bytes")
    ax.set_xscale("log", base=2)
    ax.set_xticks(seqs, [f"{s // 1024}k" if s >= 1024 and s % 1024 == 0 else str(s) for s in seqs])
    ax.set_xlabel("S, tokens per sequence (log scale)")
    ax.set_title(panel_label(panel, rows), fontsize=9)
    ax.grid(alpha=0.3)
  axes[0].set_ylabel("fraction of the memory floor\n(floor time / time; 1 = reads at the floor's speed)")
  axes[0].legend(fontsize=7)
  _finish(fig, path, title, doc)
  return True


def decode_sweep(path, doc):
  recs = [r for r in doc["records"] if r.get("section") == "sweep"]
  return _sweep_panels("decode_floor_fraction.png", path, doc, recs, lambda r: r["dtype"],
                       "Decode: fraction of the memory floor vs sequence length",
                       lambda dtype, rows: f"{dtype} cache, {_shape(rows[0]['shape'], ('S',))}")


def gpu_sweep(path, doc):
  recs = [r for r in doc["records"] if r.get("format") in ("contiguous", "token-major")]
  return _sweep_panels("gpu_floor_fraction.png", path, doc, recs, lambda r: r["shape"]["B"],
                       "GPU decode (bench_gpu): fraction of the memory floor vs sequence length",
                       lambda b, rows: f"B={b}, {_shape(rows[0]['shape'], ('B', 'S'))}, bf16 cache")


def cache_formats(path, doc):
  """fdecode on each cache format: contiguous time / time, grouped by (B, S)."""
  recs = [r for r in doc["records"] if r.get("format") and r["median_ms"] is not None
          and r["contender"].startswith(("fdecode", "contiguous", "paged", "int8", "fp8"))
          and r.get("section", "formats") == "formats"]
  groups = list(dict.fromkeys((r["shape"]["B"], r["shape"]["S"]) for r in recs))
  base = {(r["shape"]["B"], r["shape"]["S"]): r["median_ms"] for r in recs if r["format"] == "contiguous"}
  groups = [g for g in groups if g in base]
  if not groups:
    return False
  name = "gpu_cache_formats.png" if doc.get("bench") == "bench_gpu" else "cache_formats.png"
  fig, (ax,) = _figure(name)
  formats = list(dict.fromkeys(r["format"] for r in recs))
  width, top = min(0.8 / len(formats), 0.2), 1.0
  for i, fmt in enumerate(formats):
    xs, ys = [], []
    for j, g in enumerate(groups):
      hit = [r for r in recs if r["format"] == fmt and (r["shape"]["B"], r["shape"]["S"]) == g]
      if hit:
        xs.append(j + (i - (len(formats) - 1) / 2) * width)
        ys.append(base[g] / hit[0]["median_ms"])
    label = f"{fmt} ({next(r['dtype'] for r in recs if r['format'] == fmt)})"
    bars = ax.bar(xs, ys, width, color=colour(fmt), label=label)
    ax.bar_label(bars, fmt="%.2f", fontsize=7)
    top = max([top, *ys])
  ax.axhline(1.0, color="black", linewidth=1)
  ax.set_ylim(0, top * 1.3)  # room for the legend above the bars
  shape = recs[0]["shape"]
  ax.set_xticks(range(len(groups)), [f"B={b} S={s}" for b, s in groups])
  ax.set_xlim(-0.6, len(groups) - 0.4)
  ax.set_ylabel("speed relative to the contiguous cache\n(contiguous time / time; > 1 faster)")
  ax.set_xlabel(f"configuration ({_shape(shape, ('B', 'S'))})")
  ax.legend(fontsize=8, loc="upper left", ncols=len(formats))
  ax.grid(axis="y", alpha=0.3)
  _finish(fig, path, "Cache formats: fdecode's decode time on each format, relative to contiguous", doc)
  return True


def modifiers(path, doc):
  recs = [r for r in doc["records"] if r.get("section") == "overhead" and not r["contender"].startswith("floor")]
  plain = next((r["median_ms"] for r in recs if r["contender"] == "plain"), None)
  if not plain:
    return False
  fig, (ax,) = _figure("modifiers.png")
  names = [r["contender"] for r in recs][::-1]
  ratios = [r["median_ms"] / plain for r in recs][::-1]
  bars = ax.barh(names, ratios, color=colour("fdecode"))
  ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=2)
  ax.axvline(1.0, color="black", linewidth=1, label="plain decode")
  ax.set_xlabel(f"time / plain decode time (plain: {plain:.2f} ms; < 1: faster, e.g. a window reads fewer tokens)")
  ax.tick_params(axis="y", labelsize=8)
  ax.grid(axis="x", alpha=0.3)
  ax.legend(fontsize=8, loc="lower right")
  _finish(fig, path, f"Score modifiers: cost relative to plain decode ({_shape(recs[0]['shape'])}, "
          f"{recs[0]['dtype']})", doc)
  return True


def compile_report(path, doc):
  """GPU records: waves (programs / one wave) and the predicted fraction of the roofline."""
  recs = [r for r in doc["records"] if r.get("predicted")]
  if not recs:
    return False
  cases = list(dict.fromkeys(r["case"] for r in recs))[::-1]
  chips = list(dict.fromkeys(r["chip"] for r in recs))
  fig, axes = _figure("compile_report.png", 2, sharey=True)
  height = 0.8 / len(chips)
  for i, chip in enumerate(chips):
    by_case = {r["case"]: r for r in recs if r["chip"] == chip}
    ys = [j + ((len(chips) - 1) / 2 - i) * height for j, c in enumerate(cases) if c in by_case]  # first chip on top
    got = [by_case[c] for c in cases if c in by_case]
    for ax, xs in zip(axes, ([r["programs"] / r["one_wave"] for r in got], [r["floor_fraction"] for r in got])):
      ax.bar_label(ax.barh(ys, xs, height, color=colour(chip), label=chip.upper()), fmt="%.2f", fontsize=6, padding=1)
  axes[0].axvline(1.0, color="black", linewidth=1, label="one full wave")
  axes[0].set_yticks(range(len(cases)), cases, fontsize=7)
  axes[0].set_xlabel("programs / one wave (SMs x programs resident per SM)")
  axes[0].set_title("launch grid: waves of the chip", fontsize=9)
  axes[1].set_xlim(0, 1.1)
  axes[1].set_xlabel("predicted fraction of the roofline (floor / predicted time)")
  axes[1].set_title("roofline model incl. split partials and the busiest SM", fontsize=9)
  for ax in axes:
    ax.grid(axis="x", alpha=0.3)
  axes[0].legend(fontsize=7, loc="lower right")
  _finish(fig, path, "Compile report: deviceless compiles for each GPU, no timing "
          "(Hq, Hkv, D = 32, 8, 128 unless named)", doc)
  return True


def floor_bars(path, doc):
  """Fraction of its own floor per non-floor contender, one panel per section."""
  recs = [r for r in doc["records"] if not r["contender"].startswith("floor") and r["floor_fraction"] is not None]
  sections = list(dict.fromkeys(r.get("section", "") for r in recs))
  if not recs:
    return False
  name = f"{doc['bench'].removeprefix('bench_')}.png"
  fig, axes = _figure(name, len(sections))
  for ax, section in zip(axes, sections):
    rows = [r for r in recs if r.get("section", "") == section][::-1]
    bars = ax.barh([textwrap.fill(r["contender"], 34) for r in rows], [r["floor_fraction"] for r in rows],
                   color=[colour(r["contender"]) for r in rows])
    ax.bar_label(bars, [f"{r['floor_fraction']:.2f} ({r['median_ms']:.2f} ms)" for r in rows], fontsize=7, padding=2)
    ax.axvline(1.0, color=colour("floor"), linestyle="--", linewidth=1)
    ax.set_xlabel("fraction of its floor (floor time / time); labels: fraction (median ms)")
    ax.set_title(f"{section + ': ' if section else ''}{_shape(rows[0]['shape'])}, {rows[0]['dtype']}", fontsize=8)
    ax.tick_params(axis="y", labelsize=7)
    ax.grid(axis="x", alpha=0.3)
  _finish(fig, path, f"{doc['bench']}: each contender against the floor of the bytes it must read", doc)
  return True


def ragged_times(path, doc):
  """bench_ragged: each contender's median time (log scale) per section, labelled with its
  ratio to the one ragged_decode call, floor included."""
  recs = [r for r in doc["records"] if r.get("median_ms") is not None]
  sections = list(dict.fromkeys(r.get("section", "") for r in recs))
  if not recs:
    return False
  fig, axes = _figure("ragged.png", len(sections))
  for ax, section in zip(axes, sections):
    rows = [r for r in recs if r.get("section", "") == section][::-1]
    ragged = next((r["median_ms"] for r in rows if r["contender"].startswith("ragged_decode (")), None)
    bars = ax.barh([textwrap.fill(r["contender"], 30) for r in rows], [r["median_ms"] for r in rows],
                   color=[colour(r["contender"]) for r in rows])
    ax.bar_label(bars, [f"{r['median_ms']:.1f} ms" + (f" ({r['median_ms'] / ragged:.2f}x)" if ragged else "")
                        for r in rows], fontsize=7, padding=2)
    ax.set_xscale("log")
    ax.set_xlim(right=max(r["median_ms"] for r in rows) * 30)  # room for the labels
    ax.set_xlabel("median ms per step (log scale); (x) = time / ragged_decode's", fontsize=9)
    ax.set_title(f"{section}: {_shape(rows[0]['shape'])}, {rows[0]['dtype']}", fontsize=7)
    ax.tick_params(axis="y", labelsize=7)
    ax.grid(axis="x", alpha=0.3)
  _finish(fig, path, "bench_ragged: one serving step's attention, packed ragged vs one-T flash_decode", doc)
  return True


def serving(path, doc):
  """bench_serving: tokens/s of each contender (x batch-4 generate), and the demo workload's
  step times over its steps, coloured by the bucket each step ran over."""
  recs = [r for r in doc["records"] if r.get("section") == "throughput"]
  steps = doc.get("steps") or []
  if not recs or not steps:
    return False
  fig, (ax, ax2) = _figure("serving.png", 2)
  base = next((r["tokens_per_s"] for r in recs if "batch 4" in r["contender"]), None)
  rows = recs[::-1]
  bars = ax.barh([textwrap.fill(r["contender"], 30) for r in rows], [r["tokens_per_s"] for r in rows],
                 color=[colour(r["contender"]) for r in rows])
  ax.bar_label(bars, [f"{r['tokens_per_s']:.1f}" + (f" ({r['tokens_per_s'] / base:.2f}x)" if base else "")
                      for r in rows], fontsize=7, padding=2)
  ax.set_xlim(right=max(r["tokens_per_s"] for r in rows) * 1.35)  # room for the labels
  ax.set_xlabel("generated tokens / s after compilation; (x) = over batch-4 generate", fontsize=9)
  ax.set_title(f"throughput: {_shape(recs[0]['shape'])}", fontsize=8)
  ax.tick_params(axis="y", labelsize=7)
  ax.grid(axis="x", alpha=0.3)
  buckets = sorted({s["rows"] for s in steps})
  cmap = _plt().get_cmap("viridis")
  for i, n in enumerate(buckets):
    got = [s for s in steps if s["rows"] == n]
    ax2.bar([s["step"] for s in got], [s["ms"] for s in got], color=cmap(i / max(len(buckets) - 1, 1)),
            label=f"bucket N={n}, M={got[0]['seqs']}")
  for name, ms in (doc.get("generate_ms") or {}).items():
    ax2.axhline(ms, color=colour("floor"), linestyle="--" if name == "batch1" else ":", linewidth=1,
                label=f"generate step, {name.replace('batch', 'batch ')}: {ms:.0f} ms")
  ax2.set_ylim(0, max(s["ms"] for s in steps) * 1.4)  # room for the legend above the bars
  ax2.set_xlabel("engine step (request i arrives at step i)")
  ax2.set_ylabel("step ms (last timed round)")
  ax2.set_title("the demo workload's steps, by the bucket each ran over", fontsize=8)
  ax2.legend(fontsize=6, ncols=2)
  ax2.grid(axis="y", alpha=0.3)
  _finish(fig, path, "bench_serving: continuous batching over token-count buckets vs generate", doc)
  return True


FIGURES = (("decode_floor_fraction.png", "bench_decode.json", decode_sweep),
           ("cache_formats.png", "bench_decode.json", cache_formats),
           ("modifiers.png", "bench_variants.json", modifiers),
           ("compile_report.png", "compile_report.json", compile_report),
           ("gpu_floor_fraction.png", "bench_gpu.json", gpu_sweep),
           ("gpu_cache_formats.png", "bench_gpu.json", cache_formats),
           ("mla_sparse.png", "bench_mla_sparse.json", floor_bars),
           ("cascade.png", "bench_cascade.json", floor_bars),
           ("ragged.png", "bench_ragged.json", ragged_times),
           ("serving.png", "bench_serving.json", serving))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--in", dest="src", default=str(HERE / "results"), help="directory of the JSON results")
  p.add_argument("--out", default=str(HERE / "plots"), help="directory for the PNGs")
  a = p.parse_args(argv)
  try:
    _plt()
  except ImportError:
    print("plot.py needs matplotlib: pip install matplotlib (fdecode's bench extra)", file=sys.stderr)
    return 2
  src, out = pathlib.Path(a.src), pathlib.Path(a.out)
  out.mkdir(parents=True, exist_ok=True)
  for png, source, draw in FIGURES:
    if not (src / source).exists():
      print(f"[plot] {png}: skipped, no {src / source}", file=sys.stderr)
    elif draw(out / png, load(src / source)):
      print(f"[plot] {out / png}", file=sys.stderr)
    else:
      print(f"[plot] {png}: skipped, {source} has no records for it", file=sys.stderr)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
