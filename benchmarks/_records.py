"""The benchmarks' JSON results: one record schema, written by every script, read by plot.py.

A results file (``benchmarks/results/<bench>.json`` by default, ``--json PATH``) is one
object::

  {"bench": "bench_decode", "machine": "...", "command": "python benchmarks/...",
   "date": "2026-11-25T10:00", "records": [record, ...]}

and a record is one contender at one shape::

  bench           str    the script ("bench_decode", "bench_gpu", "compile_report", ...)
  contender       str    the row's name, as in the script's table
  shape           dict   the problem's dimensions, e.g. {"B": 4, "S": 16384, "Hkv": 8, "Hq": 32, "D": 128}
  dtype           str    the cache's dtype or format ("float32", "bfloat16", "int8", ...)
  median_ms       float  median milliseconds per call (compile apart); null: not timed
  gb_per_s        float  bytes the contender must read / median time, in GB/s (1e9 B/s); null: not timed
  floor_fraction  float  floor time / this time, the floor reading the same bytes; null: no floor
  machine         str    the machine line of the run (CPU model and cores, backend, device, jax)

plus optional fields a script adds (``section``, ``compile_s``, ``format``, ``chip``, ...),
documented where the script builds its records. plot.py loads files with `load`.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import sys

SCHEMA = ("bench", "contender", "shape", "dtype", "median_ms", "gb_per_s", "floor_fraction", "machine")
RESULTS_DIR = pathlib.Path(__file__).resolve().parent / "results"


def cpu_model() -> str:
  """The host CPU's model name and its wide SIMD flags, from /proc/cpuinfo."""
  try:
    with open("/proc/cpuinfo") as f:
      info = f.read()
    name = next(l.split(":", 1)[1].strip() for l in info.splitlines() if l.startswith("model name"))
    flags = next(l for l in info.splitlines() if l.startswith("flags")).split()
    simd = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{name} ({'/'.join(simd)})"
  except (OSError, StopIteration):
    return platform.processor() or platform.machine()


def machine_line() -> str:
  """The machine a run measured: host CPU and cores, JAX backend and device kind, jax version."""
  import jax  # pylint: disable=g-import-not-at-top  (plot.py reads records without JAX)
  return (f"{cpu_model()}, {os.cpu_count()} cores, backend {jax.default_backend()} "
          f"({jax.devices()[0].device_kind}), jax {jax.__version__}")


def record(bench, contender, *, shape, dtype, seconds, nbytes, floor_seconds, machine, **extra) -> dict:
  """One record. ``seconds``: median per call (None: not timed); ``nbytes``: bytes the
  contender must read; ``floor_seconds``: the floor's time over the same bytes (None: no floor)."""
  timed = bool(seconds)
  return dict(bench=bench, contender=contender, shape=dict(shape), dtype=str(dtype),
              median_ms=seconds * 1e3 if timed else None,
              gb_per_s=nbytes / seconds / 1e9 if timed and nbytes else None,
              floor_fraction=floor_seconds / seconds if timed and floor_seconds else None,
              machine=machine, **extra)


def table_records(bench, rows, *, shape, dtype, machine, **extra) -> list[dict]:
  """Records of a table of ``(name, seconds, compile seconds, bytes)`` rows, each against the
  nearest row above whose name starts with "floor" (the convention of the printed tables)."""
  out, floor = [], None
  for name, sec, comp, nbytes in rows:
    if name.startswith("floor"):
      floor = sec
    out.append(record(bench, name, shape=shape, dtype=dtype, seconds=sec, nbytes=nbytes,
                      floor_seconds=floor, machine=machine, compile_s=comp, **extra))
  return out


def add_json_arg(parser, bench):
  """``--json PATH``: where the script writes its records (default results/<bench>.json)."""
  parser.add_argument("--json", default=str(RESULTS_DIR / f"{bench}.json"), metavar="PATH",
                      help=f"write the results as JSON records here (default benchmarks/results/{bench}.json; "
                      "'' writes none)")


def write(path, bench, records, *, machine, argv=None, **fields):
  """Writes one results file (see the module docstring), with ``fields`` as further top-level
  entries (bench_gpu keeps its "meta" and "rows"); ``path`` '' or None writes nothing."""
  if not path:
    return
  for r in records:
    missing = [k for k in SCHEMA if k not in r]
    if missing:
      raise ValueError(f"record {r.get('contender')!r} lacks {missing}")
  argv = sys.argv[1:] if argv is None else list(argv)
  doc = dict(bench=bench, machine=machine, command=" ".join([f"python benchmarks/{bench}.py", *argv]),
             date=datetime.datetime.now().isoformat(timespec="minutes"), records=records, **fields)
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(doc, indent=1) + "\n")


def load(path) -> dict:
  """A results file, checked: every record has the schema's keys (ValueError naming the file if not)."""
  doc = json.loads(pathlib.Path(path).read_text())
  for r in doc.get("records", ()):
    missing = [k for k in SCHEMA if k not in r]
    if missing:
      raise ValueError(f"{path}: record {r.get('contender')!r} lacks {missing}")
  return doc
