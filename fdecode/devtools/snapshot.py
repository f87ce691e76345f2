"""What a refactor must not change, written to JSON to compare before and after.

``python -m fdecode.devtools.snapshot plans OUT.json``: `fdecode.plan` of every call of
`CORPUS` lowered for CPU, GPU and TPU, each plan as its flat field dict
(`flat_fields`: nested sub-plans flattened, so a plan split into parts compares equal to
the flat plan it replaced).

``python -m fdecode.devtools.snapshot compile OUT.json [h100,a100,v5e,v6e] [WORD,...]`` (in
the compile tier's environment, ``.venv-chips``, with ``JAX_PLATFORMS=cpu``): every
compile-tier case's report per chip (only the cases whose name contains one of the words,
when given), less its timings: launches, host waits, each kernel's grid, threads, shared
memory, registers and spills, custom calls, copies, cost-model bytes.

``python -m fdecode.devtools.snapshot diff A.json B.json``: the entries that differ, over
the entries B has (a snapshot of some cases compares with a full one).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import sys

# The traced-call corpus: (name, shapes and options). Shapes: q, k, v (None: MLA), lengths;
# every call is traced, nothing runs.
_B, _HQ, _HKV, _S, _D = 2, 8, 2, 1024, 128


def _corpus():
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  f32, bf16, i32 = jnp.float32, jnp.bfloat16, jnp.int32
  q1, q4 = (_B, _HQ, _D), (_B, 4, _HQ, _D)
  kc = (_B, _HKV, _S, _D)
  pool = (_HKV, 64, 16, _D)
  nhd_pool = (64, 16, _HKV, _D)
  calls = {
      "contiguous-bf16": dict(q=(q1, bf16), k=(kc, bf16), v=(kc, bf16)),
      "contiguous-f32": dict(q=(q1, f32), k=(kc, f32), v=(kc, f32)),
      "contiguous-t4": dict(q=(q4, bf16), k=(kc, bf16), v=(kc, bf16)),
      "contiguous-g5-t7": dict(q=((_B, 7, 10, _D), bf16), k=(kc, bf16), v=(kc, bf16)),
      "contiguous-d80": dict(q=((_B, _HQ, 80), bf16), k=((_B, _HKV, _S, 80), bf16), v=((_B, _HKV, _S, 80), bf16)),
      "contiguous-d72": dict(q=((_B, _HQ, 72), bf16), k=((_B, _HKV, _S, 72), bf16), v=((_B, _HKV, _S, 72), bf16)),
      "contiguous-f16": dict(q=(q1, jnp.float16), k=(kc, jnp.float16), v=(kc, jnp.float16)),
      "nhd-contiguous": dict(q=(q1, bf16), k=((_B, _S, _HKV, _D), bf16), v=((_B, _S, _HKV, _D), bf16),
                             kv_layout="NHD"),
      "paged16": dict(q=(q1, bf16), k=(pool, bf16), v=(pool, bf16), block_tables=((_B, 64), i32)),
      "paged1": dict(q=(q1, bf16), k=((_HKV, 2048, 1, _D), bf16), v=((_HKV, 2048, 1, _D), bf16),
                     block_tables=((_B, 1024), i32)),
      "paged16-balance": dict(q=(q1, bf16), k=(pool, bf16), v=(pool, bf16), block_tables=((_B, 64), i32),
                              num_splits="balance"),
      "nhd-paged16": dict(q=(q1, bf16), k=(nhd_pool, bf16), v=(nhd_pool, bf16), block_tables=((_B, 64), i32),
                          kv_layout="NHD"),
      "int8-token": dict(q=(q1, bf16), k=(kc, jnp.int8), v=(kc, jnp.int8), k_scale=(kc[:3] + (1,), f32),
                         v_scale=(kc[:3] + (1,), f32)),
      "fp8-paged": dict(q=(q1, bf16), k=(pool, jnp.float8_e4m3fn), v=(pool, jnp.float8_e4m3fn),
                        block_tables=((_B, 64), i32), k_scale=((_HKV, 64, 16, 1), f32),
                        v_scale=((_HKV, 64, 16, 1), f32)),
      "mla-bf16-g16": dict(q=((_B, 16, 576), bf16), k=((_B, 1, _S, 576), bf16), v=None, v_head_dim=512),
      "mla-bf16-g8": dict(q=((_B, 8, 576), bf16), k=((_B, 1, _S, 576), bf16), v=None, v_head_dim=512),
      "window-softcap": dict(q=(q4, bf16), k=(kc, bf16), v=(kc, bf16), window=256, logits_soft_cap=30.0),
      "mask-per-head": dict(q=(q4, bf16), k=(kc, bf16), v=(kc, bf16), mask=((_B, 4, _HQ, _S), jnp.bool_)),
      "sinks-alibi": dict(q=(q1, bf16), k=(kc, bf16), v=(kc, bf16), sinks=((_HQ,), f32),
                          alibi_slopes=((_HQ,), f32)),
      "sparse-shared": dict(q=(q1, bf16), k=(kc, bf16), v=(kc, bf16), indices=((_B, 64), i32)),
      "splits-3": dict(q=(q1, bf16), k=(kc, bf16), v=(kc, bf16), num_splits=3, block_k=64),
      "mosaic-gpu-rows": dict(q=(q1, bf16), k=(kc, bf16), v=(kc, bf16), impl="mosaic_gpu"),
  }
  return calls


def flat_fields(plan) -> dict:
  """A plan's fields as one flat dict: a nested dataclass contributes its own fields
  (recursively) under their names; enums become their values; tuples lists."""
  out = {"kind": type(plan).__name__}

  def walk(obj):
    for field in dataclasses.fields(obj):
      value = getattr(obj, field.name)
      if dataclasses.is_dataclass(value) and not isinstance(value, type):
        walk(value)
      else:
        out[field.name] = _plain(value)

  walk(plan)
  return out


def _plain(value):
  if isinstance(value, enum.Enum):
    return _plain(value.value)
  if isinstance(value, (tuple, list)):
    return [_plain(v) for v in value]
  if isinstance(value, (bool, int, float, str)) or value is None:
    return value
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
  return repr(value)


def plans() -> dict:
  """``{call: {platform: [flat plan, ...] or the error}}`` over `CORPUS`."""
  import jax  # pylint: disable=g-import-not-at-top
  import fdecode  # pylint: disable=g-import-not-at-top
  out = {}
  for name, spec in _corpus().items():
    spec = dict(spec)
    arrays = {}
    for key in ("q", "k", "v", "block_tables", "k_scale", "v_scale", "mask", "sinks", "alibi_slopes", "indices"):
      if key in spec:
        given = spec.pop(key)
        arrays[key] = None if given is None else jax.ShapeDtypeStruct(*given)
    q, k, v = arrays.pop("q"), arrays.pop("k"), arrays.pop("v")
    lengths = jax.ShapeDtypeStruct((q.shape[0],), "int32")
    out[name] = {}
    for platform in ("cpu", "gpu", "tpu"):
      try:
        out[name][platform] = [flat_fields(p) for p in fdecode.plan(q, k, v, lengths, platform=platform,
                                                                    **arrays, **spec)]
      except ValueError as e:
        out[name][platform] = f"ValueError: {e}"
  return out


def compile_reports(targets, words=()) -> dict:
  """``{target: {case: report}}`` of the compile tier's cases (those whose name contains one
  of ``words``, if any), timings dropped."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  cases = os.path.join(root, "tests", "compile_tier", "cases.py")
  sys.path.insert(0, os.path.dirname(cases))
  from cases import names_for  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  from fdecode.devtools.compile_check import run_targets  # pylint: disable=g-import-not-at-top
  chosen = lambda t: [n for n in names_for(t) if not words or any(w in n for w in words)]
  out = run_targets(cases, {t: chosen(t) for t in targets})
  for reports in out.values():
    for report in reports.values():
      report.pop("seconds", None)
      report.pop("trace", None)
  return out


def diff(a, b, path="") -> list[str]:
  """The paths where two snapshots differ."""
  if isinstance(a, dict) and isinstance(b, dict):
    lines = []
    for key in sorted(b, key=str):
      if key not in a:
        lines.append(f"{path}/{key}: only in B")
      else:
        lines += diff(a[key], b[key], f"{path}/{key}")
    return lines
  if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
    return [line for i, (x, y) in enumerate(zip(a, b)) for line in diff(x, y, f"{path}[{i}]")]
  return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def main(argv) -> int:
  what = argv[0]
  if what == "diff":
    with open(argv[1]) as fa, open(argv[2]) as fb:
      lines = diff(json.load(fa), json.load(fb))
    print("\n".join(lines) or "identical")
    return 1 if lines else 0
  data = plans() if what == "plans" else compile_reports(
      (argv[2] if len(argv) > 2 else "h100,a100,v5e,v6e").split(","),
      tuple(argv[3].split(",")) if len(argv) > 3 else ())
  with open(argv[1], "w") as f:
    json.dump(data, f, indent=1, sort_keys=True)
  return 0


if __name__ == "__main__":
  raise SystemExit(main(sys.argv[1:]))
