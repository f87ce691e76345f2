"""Sequence-parallel decode over N local processes x M CPU devices (``scripts/multihost_demo``,
``python -m fdecode.cli.multihost_demo``).

Without ``--process-id`` this is the launcher: it picks a free port, starts N workers
(``python -m fdecode.cli.multihost_demo --process-id i ...``), waits for them and prints OK if
all agree with the reference. Each worker joins the JAX distributed runtime (gloo CPU
collectives), builds one mesh over all N*M devices, splits the cache's token axis over
it, runs `fdecode.sharded_flash_decode` and checks its result against
`fdecode.reference.reference_decode` computed locally.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time

from fdecode import cli


def main(argv=None, prog: str | None = None) -> int:
  """Entry point: ``argv`` defaults to ``sys.argv[1:]``, ``prog`` (usage lines, ``--help``)
  to the command the user ran. Returns the exit status (0 OK, 1 a failed worker)."""
  p = argparse.ArgumentParser(prog=prog or cli.prog("fdecode.cli.multihost_demo"),
                              description=__doc__.split("\n\n")[0].replace("\n", " "))
  p.add_argument("num_processes", type=int, nargs="?", default=2, help="N local processes")
  p.add_argument("local_devices", type=int, nargs="?", default=2, help="M CPU devices each")
  p.add_argument("--tokens-per-device", type=int, default=64, help="cache tokens per device")
  p.add_argument("--new-tokens", type=int, default=2, help="T new tokens per sequence")
  p.add_argument("--timeout", type=float, default=240.0, help="seconds before the workers are killed")
  p.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
  p.add_argument("--process-id", type=int, default=None, help=argparse.SUPPRESS)
  a = p.parse_args(argv)
  if a.num_processes < 1 or a.local_devices < 1:
    p.error(f"need N >= 1 and M >= 1, got N={a.num_processes} M={a.local_devices}")
  if a.process_id is None:
    return _launch(a)
  return _worker(a)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _launch(a) -> int:
  port = a.port or _free_port()
  print(f"multihost demo: {a.num_processes} processes x {a.local_devices} CPU devices, "
        f"coordinator 127.0.0.1:{port}", flush=True)
  common = [str(a.num_processes), str(a.local_devices), "--port", str(port),
            "--tokens-per-device", str(a.tokens_per_device), "--new-tokens", str(a.new_tokens)]
  procs = [subprocess.Popen([sys.executable, "-m", "fdecode.cli.multihost_demo", *common,
                             "--process-id", str(i)])
           for i in range(a.num_processes)]
  deadline = time.monotonic() + a.timeout
  codes = []
  try:
    for proc in procs:
      codes.append(proc.wait(timeout=max(deadline - time.monotonic(), 1.0)))
  except subprocess.TimeoutExpired:
    print(f"multihost demo: FAILED, workers still running after {a.timeout:.0f}s", flush=True)
    return 1
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
        proc.wait()
  if any(codes):
    print(f"multihost demo: FAILED, worker exit codes {codes}", flush=True)
    return 1
  print("OK", flush=True)
  return 0


def _worker(a) -> int:
  # The device count must be set before JAX initializes its CPU backend.
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={a.local_devices}").strip()
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{a.port}",
                             num_processes=a.num_processes, process_id=a.process_id)
  import fdecode  # pylint: disable=g-import-not-at-top
  from fdecode.reference import reference_decode  # pylint: disable=g-import-not-at-top

  n = jax.device_count()
  mesh = jax.make_mesh((n,), ("seq",))
  b, t, hq, hkv, d = 2, a.new_tokens, 4, 2, 32
  s = a.tokens_per_device * n
  # Every process draws the same global problem; each keeps only its devices' chunks.
  rng = np.random.default_rng(0)
  q_np = rng.standard_normal((b, t, hq, d), np.float32)
  k_np = rng.standard_normal((b, hkv, s, d), np.float32)
  v_np = rng.standard_normal((b, hkv, s, d), np.float32)
  # One full sequence, one whose causal window straddles a device boundary.
  lengths_np = np.array([s, a.tokens_per_device + 1], np.int32)

  def global_array(x, spec):
    sharding = NamedSharding(mesh, spec)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

  q = global_array(q_np, P())
  k = global_array(k_np, P(None, None, "seq", None))
  v = global_array(v_np, P(None, None, "seq", None))
  lengths = global_array(lengths_np, P())
  out, lse = fdecode.sharded_flash_decode(q, k, v, lengths, mesh=mesh, seq_axis="seq",
                                          impl="xla", return_lse=True)
  # The output is replicated over the seq axis: every local shard is the whole result.
  out_np = np.asarray(out.addressable_shards[0].data)
  lse_np = np.asarray(lse.addressable_shards[0].data)
  ref, ref_lse = reference_decode(jnp.asarray(q_np), jnp.asarray(k_np), jnp.asarray(v_np),
                                  jnp.asarray(lengths_np))
  err = float(np.max(np.abs(out_np - np.asarray(ref))))
  lse_err = float(np.max(np.abs(lse_np - np.asarray(ref_lse))))
  ok = err <= 3e-5 and lse_err <= 3e-5 and np.isfinite(out_np).all()
  print(f"  process {a.process_id}/{a.num_processes}: {jax.local_device_count()} of {n} devices, "
        f"cache k/v {k_np.shape} split over 'seq' in chunks of {a.tokens_per_device}; "
        f"max |out - ref| {err:.1e}, max |lse - ref| {lse_err:.1e}: {'ok' if ok else 'MISMATCH'}",
        flush=True)
  jax.distributed.shutdown()
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
