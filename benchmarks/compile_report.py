"""What the real chip compilers make of fdecode's benchmark grid, with no chip.

One table per chip, a row per kernel variant (bf16, paged 16, int8 and fp8 with per-token
scales) of the benchmark grid (Hq=32, Hkv=8, D=128, every sequence full, at B x S of
1 x 32k, 8 x 32k, 64 x 4k; and B=1, Hkv=1, Hq=8, S=1M, FlashDecoding's long-context case):

* GPU (H100 sm_90a, A100 sm_80; XLA:GPU + ptxas, `fdecode.devtools.compile_check`): registers,
  spills, shared memory, programs, programs resident per SM, waves, and the predicted time
  at the memory roofline: the cache plus the split partials (written by the kernel, read
  by the merge), over the bandwidth the launch keeps busy (`fdecode.kernels.triton.gpu_busy`:
  equal programs; the busiest SM's share, and the last partial wave at the compiled
  residency). Compute and launch latency are left out: a bound on what the launch allows.
* TPU (v5e, v6e; libtpu): whether it compiles, the VMEM footprint and limit of the plan
  (`fdecode.kernels.mosaic_tpu.plan`), tokens and bytes per grid step, grid steps, and
  the roofline time beside the per-step overhead (~0.35 us a step, spread over the
  chip's TensorCores) that double buffering has to hide.

``--invariant``: the batch-invariant mode's grid instead (bf16, Hq=32, Hkv=8, B = 1 / 8 / 64
x S = 4k / 32k / 128k), each shape's default plan (``bf16``) beside the mode's
(``invariant``): on GPU the Triton kernels' invariant plan, on TPU the Mosaic kernels'.

Run in the compile tier's environment (``scripts/compile_tier`` makes ``.venv-chips``):
``JAX_PLATFORMS=cpu .venv-chips/bin/python benchmarks/compile_report.py [--chips h100,a100] [--json OUT]``.
The tables go to stdout (markdown, for benchmarks/RESULTS.md); the rows to ``--json``
(default benchmarks/results/compile_report.json): the raw rows per chip under "chips", and
"records" (benchmarks/_records.py), one per chip and case, never timed (median_ms and
gb_per_s null). A GPU record's floor_fraction is the *predicted* floor / predicted time
(``predicted: true``), with extra fields ``chip``, ``case``, ``programs``, ``one_wave``
(SMs x resident programs per SM), ``waves``, ``floor_us``, ``predicted_us``, ``regs``,
``spills`` (``error`` if rejected); a TPU record has no floor_fraction and carries
``chip``, ``case``, ``compiles``, ``steps``, ``vmem``, ``floor_us``, ``overhead_us``.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import fdecode  # noqa: E402
from fdecode.config import DEFAULT_SPLIT_SIZE  # noqa: E402
from fdecode.kernels.common import chips  # noqa: E402
from fdecode.kernels.triton import gpu_busy  # noqa: E402
from _records import add_json_arg, machine_line, record, write  # noqa: E402  (benchmarks/ is on sys.path)

GRID = {"B=1 S=32k": (1, 8, 32, 32768), "B=8 S=32k": (8, 8, 32, 32768),
        "B=64 S=4k": (64, 8, 32, 4096), "B=1 Hkv=1 S=1M": (1, 1, 8, 1 << 20)}
VARIANTS = ("bf16", "paged16", "int8", "fp8")
INVARIANT_GRID = {f"B={b} S={s // 1024}k": (b, 8, 32, s) for b in (1, 8, 64) for s in (4096, 32768, 131072)}
INVARIANT_VARIANTS = ("bf16", "invariant")
SHAPES = {**GRID, **INVARIANT_GRID}  # (the names both grids hold are the same shapes)
D = 128
_STEP_OVERHEAD_S = 0.35e-6  # per Mosaic grid step (RESULTS.md, roofline on paper)


def _arrays(spec, variant, b, hkv, hq, s):
  """flash_decode's operands for one variant, as ``spec(shape, dtype)`` structs."""
  q = spec((b, hq, D), jnp.bfloat16)
  opts = {}
  if variant == "paged16":
    n = s // 16
    lead = (hkv, b * n, 16)
    opts["block_tables"] = spec((b, n), jnp.int32)
  else:
    lead = (b, hkv, s)
  dtype = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}.get(variant, jnp.bfloat16)
  k, v = spec(lead + (D,), dtype), spec(lead + (D,), dtype)
  if variant in ("int8", "fp8"):
    opts.update(k_scale=spec(lead + (1,), jnp.float32), v_scale=spec(lead + (1,), jnp.float32))
  if variant == "invariant":
    opts["batch_invariant"] = True
  return q, k, v, spec((b,), jnp.int32), opts


def kv_bytes(variant, b, hkv, s) -> int:
  """The bytes a decode must read: K and V, plus per-token float32 scales."""
  per_token = 2 * D * (1 if variant in ("int8", "fp8") else 2) + (8 if variant in ("int8", "fp8") else 0)
  return b * hkv * s * per_token


def _build(target, *, variant, shape):
  q, k, v, n, opts = _arrays(target.spec, variant, *shape)
  static = {name: opts.pop(name) for name in ("batch_invariant",) if name in opts}  # closed over, not traced
  return (lambda q, k, v, n, opts: fdecode.flash_decode(q, k, v, n, **opts, **static)), (q, k, v, n, opts)


CASES = {f"{v} {g}": functools.partial(_build, variant=v, shape=shape)
         for g, shape in GRID.items() for v in VARIANTS}
INVARIANT_CASES = {f"{v} {g}": functools.partial(_build, variant=v, shape=shape)
                   for g, shape in INVARIANT_GRID.items() for v in INVARIANT_VARIANTS}
DEFAULT_NAMES = list(CASES)
CASES.update({n: c for n, c in INVARIANT_CASES.items() if n not in CASES})


def gpu_row(gpu: chips.Gpu, name: str, report: dict) -> dict:
  variant, grid_name = name.split(" ", 1)
  b, hkv, hq, s = SHAPES[grid_name]
  kv = kv_bytes(variant, b, hkv, s)
  if not report["ok"]:
    return dict(case=name, error=report["error"][-300:])
  (k,) = [x for x in report["kernels"] if x["name"].startswith("fdecode_split_kv")]
  programs = math.prod(k["grid"])
  resident = gpu.resident_programs(threads=k["threads"], regs=k["regs"], smem=k["smem"])
  busy = gpu_busy(programs, gpu.sms, resident)
  rows_p = -(-(hq // hkv) // 16) * 16  # the kernel's rows, padded to a dot tile
  merge = 2 * 4 * b * hkv * k["grid"][2] * rows_p * (D + 1)  # partials written, then read
  return dict(case=name, regs=k["regs"], spills=k["spill_stores"] + k["spill_loads"], smem=k["smem"],
              threads=k["threads"], grid=k["grid"], programs=programs, resident=resident,
              waves=programs / (gpu.sms * resident), busy=busy, merge_bytes=merge,
              floor_us=kv / gpu.bandwidth * 1e6, predicted_us=(kv + merge) / busy / gpu.bandwidth * 1e6)


def tpu_row(tpu: chips.Tpu, target, name: str, report: dict) -> dict:
  from fdecode.kernels.mosaic_tpu.plan import plan, split_count  # pylint: disable=g-import-not-at-top
  variant, grid_name = name.split(" ", 1)
  b, hkv, hq, s = SHAPES[grid_name]
  kv = kv_bytes(variant, b, hkv, s)
  spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype)
  q, k, v, _, opts = _arrays(spec, variant, b, hkv, hq, s)
  invariant = opts.pop("batch_invariant", False)
  q_rows = spec((b, hkv, hq // hkv, D), jnp.bfloat16)
  p = plan(q_rows, k, v, **opts)
  blocks = -(-s // p.block)
  if invariant:  # `fdecode.kernels.mosaic_tpu.plan.make_plan`'s split_size: every split of whole blocks, stepped
    per = -(-DEFAULT_SPLIT_SIZE // p.block)
    steps = b * hkv * -(-blocks // per) * per
  else:
    splits = split_count(b, hkv, blocks, tpu.cores_per_chip)
    steps = b * hkv * splits * -(-blocks // splits)
  return dict(case=name, ok=report["ok"], error=None if report["ok"] else report["error"][-300:],
              vmem=p.vmem_bytes, vmem_limit=p.vmem_limit_bytes, tokens_per_step=p.block,
              bytes_per_step=kv // steps, steps=steps, floor_us=kv / tpu.bandwidth * 1e6,
              overhead_us=steps * _STEP_OVERHEAD_S / tpu.cores_per_chip * 1e6,
              bytes_accessed=report.get("bytes_accessed"), kv=kv)


def _mib(x):
  return f"{x / 2**20:.1f} MiB" if x >= 2**20 else f"{x / 2**10:.0f} KiB"


def markdown(chip: str, rows: list[dict]) -> str:
  if chip in chips.GPUS:
    gpu = chips.GPUS[chip]
    out = [f"#### {chip.upper()} ({gpu.arch}, {gpu.sms} SMs, {gpu.bandwidth / 1e12:.2f} TB/s)", "",
           "| case | regs | spills | smem | threads | grid | resident/SM | waves | busy | merge | floor | predicted | floor / predicted |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
      if "error" in r:
        out.append(f"| {r['case']} | rejected: {r['error']} |")
        continue
      out.append(f"| {r['case']} | {r['regs']} | {r['spills']} B | {_mib(r['smem'])} | {r['threads']} | "
                 f"{'x'.join(map(str, r['grid']))} | {r['resident']} | {r['waves']:.2f} | {r['busy']:.2f} | "
                 f"{_mib(r['merge_bytes'])} | {r['floor_us']:.1f} us | {r['predicted_us']:.1f} us | "
                 f"{r['floor_us'] / r['predicted_us']:.2f} |")
  else:
    tpu = chips.TPUS[chip]
    out = [f"#### TPU {chip} ({tpu.bandwidth / 1e9:.0f} GB/s, {tpu.cores_per_chip} TensorCore(s) a chip)", "",
           "| case | compiles | VMEM (limit) | tokens / step | bytes / step | steps | floor | step overhead | cost model bytes / KV |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
      ratio = "" if not r["bytes_accessed"] else f"{r['bytes_accessed'] / r['kv']:.3f}"
      out.append(f"| {r['case']} | {'yes' if r['ok'] else 'no: ' + r['error']} | {_mib(r['vmem'])} "
                 f"({_mib(r['vmem_limit'])}) | {r['tokens_per_step']} | {_mib(r['bytes_per_step'])} | "
                 f"{r['steps']} | {r['floor_us']:.1f} us | {r['overhead_us']:.1f} us | {ratio} |")
  return "\n".join(out)


def records_of(chip: str, rows: list[dict], machine: str) -> list[dict]:
  """One chip's rows as records (see the module docstring)."""
  out = []
  for r in rows:
    variant, grid_name = r["case"].split(" ", 1)
    b, hkv, hq, s = SHAPES[grid_name]
    common = dict(shape=dict(B=b, S=s, Hkv=hkv, Hq=hq, D=D), seconds=None, nbytes=None, machine=machine,
                  dtype={"int8": "int8", "fp8": "float8_e4m3fn"}.get(variant, "bfloat16"), chip=chip, case=r["case"])
    if chip in chips.GPUS and "error" in r:
      out.append(record("compile_report", f"fdecode {variant}", floor_seconds=None, error=r["error"], **common))
    elif chip in chips.GPUS:
      sms = chips.GPUS[chip].sms
      out.append(record("compile_report", f"fdecode {variant}", floor_seconds=None, **common) | dict(
          floor_fraction=r["floor_us"] / r["predicted_us"], predicted=True, programs=r["programs"],
          one_wave=sms * r["resident"], waves=r["waves"], floor_us=r["floor_us"],
          predicted_us=r["predicted_us"], regs=r["regs"], spills=r["spills"]))
    else:
      out.append(record("compile_report", f"fdecode {variant}", floor_seconds=None, compiles=r["ok"],
                        steps=r["steps"], vmem=r["vmem"], floor_us=r["floor_us"], overhead_us=r["overhead_us"],
                        **common))
  return out


def main(argv=None):
  from fdecode.devtools.compile_check import Target, run_cases  # pylint: disable=g-import-not-at-top
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--chips", default="h100,a100,v5e,v6e")
  parser.add_argument("--invariant", action="store_true", help="the batch-invariant mode's grid (module doc)")
  add_json_arg(parser, "compile_report")
  args = parser.parse_args(argv)
  machine = f"{machine_line()}; deviceless compiles, no chip ran"
  tables, data, records = [], {}, []
  names = list(INVARIANT_CASES) if args.invariant else DEFAULT_NAMES
  for chip in args.chips.split(","):
    reports = run_cases(chip, os.path.abspath(__file__), names)
    if chip in chips.GPUS:
      rows = [gpu_row(chips.GPUS[chip], n, reports[n]) for n in names]
    else:
      rows = [tpu_row(chips.TPUS[chip], Target(chip), n, reports[n]) for n in names]
    data[chip] = rows
    records += records_of(chip, rows, machine)
    tables.append(markdown(chip, rows))
    print(tables[-1] + "\n", flush=True)
  write(args.json, "compile_report", records, machine=machine, argv=argv, chips=data)
  return 0


if __name__ == "__main__":
  sys.exit(main())
