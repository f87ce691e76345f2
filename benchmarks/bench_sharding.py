"""Sequence-parallel FlashDecode: bytes crossing devices per step, and step time vs devices.

Run: ``.venv/bin/python benchmarks/bench_sharding.py [--context S] [--iters N]``.

1. From the compiled HLO of one `sharded_flash_decode` step (seq_axis over n devices,
   abstract inputs, nothing allocated): bytes produced by cross-device ops per device,
   against the cache bytes each device holds. Only the (o, lse) states travel.
2. Step time at a fixed total cache: single-device `flash_decode` vs the cache split over
   2 and 8 simulated CPU devices. The devices are simulated
   (``--xla_force_host_platform_device_count=8``) and share this machine's cores, so the
   times show overhead, not a speed-up (the machine that produced RESULTS had 2 cores).

Both tables are also written as records (benchmarks/_records.py) to ``--json``: section
"collectives" (not timed; extra ``devices``, ``collective_bytes`` per op, ``cache_bytes``
per device) and "step time" (extra ``devices``, ``compile_s``, ``max_abs_err``; no floor).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()

import argparse  # pylint: disable=g-import-not-at-top,g-bad-import-order
import functools

import jax
import jax.numpy as jnp

import fdecode
from fdecode.devtools.collectives import collective_bytes
from _records import add_json_arg, machine_line, record, write  # benchmarks/ is on sys.path
from _timing import timeit


def _comm_table(b, t, hq, hkv, s, d, dtype, machine):
  """Prints the collectives table; returns its records."""
  print(f"\n### Bytes crossing devices per step (seq_axis; B={b}, T={t}, Hq={hq}, Hkv={hkv}, "
        f"S={s}, D={d}, {jnp.dtype(dtype).name})\n")
  print("| devices | collectives (bytes produced per device) | total per device | cache per device | ratio |")
  print("|---:|---|---:|---:|---:|")
  q = jax.ShapeDtypeStruct((b, t, hq, d), dtype)
  k = jax.ShapeDtypeStruct((b, hkv, s, d), dtype)
  lengths = jax.ShapeDtypeStruct((b,), jnp.int32)
  records = []
  for n in (2, 8):
    mesh = jax.make_mesh((n,), ("s",), devices=jax.devices()[:n])
    step = jax.jit(functools.partial(fdecode.sharded_flash_decode, mesh=mesh, seq_axis="s",
                                     impl="xla"))
    sent = collective_bytes(step.lower(q, k, k, lengths).compile().as_text())
    total = sum(sum(x) for x in sent.values())
    cache = 2 * b * hkv * s * d * jnp.dtype(dtype).itemsize // n
    ops = ", ".join(f"{op} {x}" for op, x in sent.items())
    print(f"| {n} | {ops} | {total / 1024:.1f} KiB | {cache / 2**20:.1f} MiB | {cache / max(total, 1):.0f}x |")
    records.append(record("bench_sharding", f"sharded_flash_decode, seq_axis over {n} devices",
                          shape=dict(B=b, T=t, Hq=hq, Hkv=hkv, S=s, D=d), dtype=jnp.dtype(dtype).name,
                          seconds=None, nbytes=None, floor_seconds=None, machine=machine,
                          section="collectives", devices=n, collective_bytes={op: sum(x) for op, x in sent.items()},
                          cache_bytes=int(cache)))
  return records


def _time_table(b, hq, hkv, s, d, dtype, iters, machine):
  """Prints the step-time table; returns its records."""
  kq, kk, kv = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(kq, (b, hq, d), dtype)
  k = jax.random.normal(kk, (b, hkv, s, d), dtype)
  v = jax.random.normal(kv, (b, hkv, s, d), dtype)
  lengths = jnp.full((b,), s, jnp.int32)
  kv_bytes = 2 * k.size * k.dtype.itemsize
  print(f"\n### Step time at fixed total cache (B={b}, Hq={hq}, Hkv={hkv}, S={s}, D={d}, "
        f"{jnp.dtype(dtype).name}, {kv_bytes / 2**20:.0f} MiB of KV; {os.cpu_count()} CPU cores, "
        f"devices simulated on them)\n")
  print("| devices | compile s | step median ms | GB/s of KV | max abs err vs 1 device |")
  print("|---:|---:|---:|---:|---:|")
  single = jax.jit(functools.partial(fdecode.flash_decode, impl="xla"))
  base, records = None, []
  for n in (1, 2, 8):
    if n == 1:
      fn = single
    else:
      mesh = jax.make_mesh((n,), ("s",), devices=jax.devices()[:n])
      fn = jax.jit(functools.partial(fdecode.sharded_flash_decode, mesh=mesh, seq_axis="s",
                                     impl="xla"))
    med, compile_s = timeit(fn, q, k, v, lengths, iters=iters)
    base = fn(q, k, v, lengths) if base is None else base
    err = float(jnp.max(jnp.abs(fn(q, k, v, lengths).astype(jnp.float32) - base.astype(jnp.float32))))
    print(f"| {n} | {compile_s:.2f} | {med * 1e3:.2f} | {kv_bytes / med / 1e9:.1f} | {err:.1e} |")
    name = "flash_decode, 1 device" if n == 1 else f"sharded_flash_decode, seq_axis over {n} devices"
    records.append(record("bench_sharding", name, shape=dict(B=b, Hq=hq, Hkv=hkv, S=s, D=d),
                          dtype=jnp.dtype(dtype).name, seconds=med, nbytes=kv_bytes, floor_seconds=None,
                          machine=machine, section="step time", devices=n, compile_s=compile_s, max_abs_err=err))
  return records


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--context", type=int, default=8192, help="S for the timing table")
  p.add_argument("--iters", type=int, default=10)
  add_json_arg(p, "bench_sharding")
  a = p.parse_args(argv)
  print(f"fdecode sharding benchmark on {jax.devices()[0].device_kind} ({jax.default_backend()}), "
        f"{jax.device_count()} simulated devices over {os.cpu_count()} cores")
  machine = f"{machine_line()}, {jax.device_count()} simulated devices"
  records = _comm_table(b=4, t=1, hq=32, hkv=8, s=32768, d=128, dtype=jnp.bfloat16, machine=machine)
  records += _time_table(b=2, hq=8, hkv=2, s=a.context, d=64, dtype=jnp.bfloat16, iters=a.iters, machine=machine)
  write(a.json, "bench_sharding", records, machine=machine, argv=argv)


if __name__ == "__main__":
  main()
