"""Compile fdecode for chips this host does not have: TPU with libtpu, CUDA with XLA:GPU
and ptxas, deviceless (the compile tier of the tests and `benchmarks/compile_report.py`).

Needs the chip plugins (``scripts/compile_tier`` installs them in ``.venv-chips``) and
``JAX_PLATFORMS=cpu`` set before JAX starts. Each case is compiled in a worker process:
a compiler that aborts (LLVM fatal errors do) fails that case, not the run.

A case is a function ``build(target) -> (fn, args)`` or ``(fn, args, donate_argnums)``:
``fn`` is jitted (donating those arguments, as a serving step donates its caches), ``args``
are `jax.ShapeDtypeStruct`s made with ``target.spec(shape, dtype)`` (placed on the target's
mesh). ``target.mesh(n)`` gives an n-device mesh for sharded cases.

What a compile reports (`compile_one`): for CUDA, every fdecode kernel's launch grid,
threads and shared memory (from XLA's thunk sequence) and its registers and spills
(``ptxas -v`` on the PTX XLA produced, for the target's architecture), the Mosaic GPU
kernels it embeds as custom calls (lowered, not yet assembled: that happens on a GPU) and
the launches of the whole program (every kernel of the thunk sequence) and its host waits
(conditionals and while loops, which XLA:GPU decides on the host); for TPU, success
(Mosaic rejects kernels that do not fit VMEM or its tiling) and the launches of the
optimized HLO's entry computation.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import glob
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import traceback

from fdecode.kernels.common import chips

KERNEL_PREFIX = "fdecode_"


@dataclasses.dataclass
class Target:
  """A chip to compile for: ``"h100"``, ``"a100"``, ``"v5e"``, ``"v6e"``, ``"v5p"``, ``"v4"``,
  or ``"v5e:4x4"`` (a named TPU topology: a multi-host pod slice)."""
  name: str
  topology: object = None
  _meshes: dict = dataclasses.field(default_factory=dict)

  @property
  def is_gpu(self) -> bool:
    return self.name in chips.GPUS

  @property
  def gpu(self) -> chips.Gpu:
    return chips.GPUS[self.name]

  def load(self):
    from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
    if self.is_gpu:
      self.topology = topologies.get_topology_desc(
          platform="cuda", target_config=chips.gpu_target_config(self.gpu), topology="1x1x4")
    else:
      name = chips.TPUS[self.name].topology if self.name in chips.TPUS else self.name
      self.topology = topologies.get_topology_desc(topology_name=name, platform="tpu")
    return self

  def mesh(self, n: int = 1, axes=("x",)):
    import jax  # pylint: disable=g-import-not-at-top
    import numpy as np  # pylint: disable=g-import-not-at-top
    key = (n, tuple(axes))
    if key not in self._meshes:
      devices = self.topology.devices
      if len(devices) < n:
        raise ValueError(f"{self.name}: the topology has {len(devices)} devices, {n} asked for")
      shape = (n,) if len(axes) == 1 else None
      arr = np.array(devices[:n]).reshape(shape or _mesh_shape(n, len(axes)))
      self._meshes[key] = jax.sharding.Mesh(arr, tuple(axes))
    return self._meshes[key]

  def spec(self, shape, dtype, mesh=None, pspec=None):
    """An abstract argument on ``mesh`` (default: one device). On TPU, arrays of rank >= 2
    are laid out row-major, as the kernels read them: XLA's default TPU layout puts S
    minor when the head dim is not a multiple of 128 (80, 96, 192, MLA's 576), and then
    every call copies the whole cache into the kernel's layout (`README`, TPU layouts)."""
    import jax  # pylint: disable=g-import-not-at-top
    from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=g-import-not-at-top
    mesh = mesh or self.mesh(1)
    sharding = NamedSharding(mesh, pspec or PartitionSpec())
    if not self.is_gpu and len(shape) >= 2:
      from jax.experimental.layout import Format, Layout  # pylint: disable=g-import-not-at-top
      sharding = Format(Layout(tuple(range(len(shape)))), sharding)
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def _mesh_shape(n, rank):
  if rank == 2:
    a = int(n ** 0.5)
    while n % a:
      a -= 1
    return (n // a, a)
  raise ValueError(f"mesh of rank {rank}")


def ptxas_path() -> str:
  """ptxas of the CUDA plugin's nvcc package (the one XLA:GPU itself runs)."""
  import nvidia.cuda_nvcc  # pylint: disable=g-import-not-at-top
  roots = list(getattr(nvidia.cuda_nvcc, "__path__", []))
  for root in roots:
    path = os.path.join(root, "bin", "ptxas")
    if os.path.exists(path):
      return path
  raise FileNotFoundError("ptxas not found in nvidia-cuda-nvcc-cu12")


_THUNK = re.compile(r"(\S+) grid: \[(\d+), (\d+), (\d+)\] threads: \[(\d+), (\d+), (\d+)\]\s+shared_memory: (\d+) bytes")


_THUNK_LINE = re.compile(r"^( *)\d+: (k\w+)")
_BRANCH_LINE = re.compile(r"^( *)\w+:\s*$")
_CONTAINERS = ("kConditional", "kWhile")


def gpu_launches(dump_dir: str) -> int:
  """Launches in a GPU dump's thunk sequence: every thunk (a kernel, fdecode's or XLA's, a
  custom call such as a Mosaic GPU kernel, a copy or a memset). A conditional counts as
  itself plus its longest branch (the thunks nested under it, which a step that takes
  that branch launches); a while loop as itself plus one pass of its thunks."""
  return sum(thunk_launches(open(path).read().splitlines())
             for path in glob.glob(os.path.join(dump_dir, "*thunk_sequence.txt")))


def thunk_launches(lines: list[str]) -> int:
  """`gpu_launches` of one thunk sequence's lines (nested branches indented under their
  container, each under a ``name:`` header)."""
  def block(i, indent):  # -> (launches of the thunks at ``indent`` from line i, next line)
    total = 0
    while i < len(lines):
      thunk, header = _THUNK_LINE.match(lines[i]), _BRANCH_LINE.match(lines[i])
      if thunk and len(thunk.group(1)) < indent or header and len(header.group(1)) < indent:
        break
      i += 1
      if not thunk:
        continue
      total += 1
      branches = []
      while i < len(lines) and (h := _BRANCH_LINE.match(lines[i])) and len(h.group(1)) > indent:
        n, i = block(i + 1, len(h.group(1)) + 1)
        branches.append(n)
      if thunk.group(2) in _CONTAINERS:
        total += sum(branches) if thunk.group(2) == "kWhile" else max(branches, default=0)
    return total, i
  return block(0, 0)[0]


def gpu_host_waits(dump_dir: str) -> int:
  """Conditionals and while loops in a GPU dump's thunk sequences: XLA:GPU runs each on
  the host, copying its predicate from the GPU and waiting for the stream (per
  evaluation), unless command buffers capture them (not by default)."""
  return sum(len(re.findall(r"^ *\d+: (?:kConditional|kWhile)\b", open(path).read(), re.M))
             for path in glob.glob(os.path.join(dump_dir, "*thunk_sequence.txt")))


_NOT_LAUNCHES = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
                 "partition-id", "replica-id", "opt-barrier"}


def entry_launches(hlo_text: str) -> int:
  """Launches of an optimized HLO module: the entry computation's instructions that run
  on the device (fusions, custom calls, copies, collectives), not its plumbing."""
  entry = re.search(r"\nENTRY [^\n]*\{\n(.*?)\n\}", hlo_text, re.S)
  count = 0
  for line in (entry.group(1).splitlines() if entry else []):
    m = re.search(r"=\s.*?\s([a-z][\w-]*)\(", line)
    if m and m.group(1) not in _NOT_LAUNCHES:
      count += 1
  return count


def _gpu_kernels(dump_dir: str, arch: str) -> list[dict]:
  """fdecode kernels in a GPU dump: grid / threads / shared memory, registers / spills."""
  kernels = []
  for path in glob.glob(os.path.join(dump_dir, "*thunk_sequence.txt")):
    for line in open(path):
      m = _THUNK.search(line)
      if m and m.group(1).startswith(KERNEL_PREFIX):
        g = [int(x) for x in m.groups()[1:]]
        kernels.append(dict(name=m.group(1), grid=g[0:3], threads=g[3] * g[4] * g[5], smem=g[6]))
  ptx_info = {}
  for ptx in glob.glob(os.path.join(dump_dir, "*.ptx")):
    text = open(ptx).read()
    if f".entry {KERNEL_PREFIX}" not in text:
      continue
    out = subprocess.run([ptxas_path(), f"-arch={arch}", "-v", ptx, "-o", os.devnull],
                         capture_output=True, text=True, check=False)
    log = out.stdout + out.stderr
    if out.returncode:
      raise RuntimeError(f"ptxas failed on {os.path.basename(ptx)}: {log[-2000:]}")
    for block in re.split(r"Compiling entry function ", log)[1:]:
      name = block.split("'")[1]
      spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", block)
      regs = re.search(r"Used (\d+) registers", block)
      ptx_info[name] = dict(regs=int(regs.group(1)), spill_stores=int(spill.group(1)),
                            spill_loads=int(spill.group(2)))
  for k in kernels:
    k.update(ptx_info.get(k["name"], {}))
  return kernels


def compile_one(target: Target, build) -> dict:
  """Lowers and compiles one case for ``target``; returns its report (raises on rejection)."""
  import jax  # pylint: disable=g-import-not-at-top
  fn, args, *donate = build(target)
  mesh = args[0].sharding.mesh if hasattr(args[0], "sharding") and args[0].sharding is not None else target.mesh(1)
  start = time.time()
  with tempfile.TemporaryDirectory() as dump, jax.set_mesh(mesh):
    lowered = jax.jit(fn, donate_argnums=donate[0] if donate else ()).lower(*args)
    options = {"xla_dump_to": dump} if target.is_gpu else {}
    compiled = lowered.compile(compiler_options=options)
    compiled_text = compiled.as_text()
    report = dict(ok=True, seconds=round(time.time() - start, 2))
    if target.is_gpu:
      report["kernels"] = _gpu_kernels(dump, target.gpu.arch)
      report["launches"] = gpu_launches(dump)
      report["host_waits"] = gpu_host_waits(dump)
    else:
      report["launches"] = entry_launches(compiled_text)
      text = lowered.as_text()
      report["kernels"] = [dict(name=n) for n in sorted(set(re.findall(r'(fdecode_\w+)', text)))]
    report["largest_copy_bytes"] = largest_copy_bytes(compiled_text)
    # Custom calls XLA does not launch as named kernels, e.g. Mosaic GPU's (their PTX is
    # built when the program loads on a GPU): the targets, and the fdecode kernels they carry.
    report["custom_calls"] = sorted(set(re.findall(r'custom_call_target="([^"]+)"', compiled_text)))
    report["mosaic_gpu_kernels"] = sorted(
        n for n in set(re.findall(r"\b(fdecode_\w+)", compiled_text))
        if n.endswith("_mosaic_gpu") and not n.endswith("_mosaic_gpu_mosaic_gpu"))
    cost = compiled.cost_analysis()
    if isinstance(cost, list):
      cost = cost[0] if cost else None
    report["bytes_accessed"] = None if not cost else cost.get("bytes accessed")
  return report


_COPY = re.compile(r"= (\w+)\[([\d,]*)\]\S* (?:transpose|copy)\(")
_HLO_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "s16": 2,
              "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}


def largest_copy_bytes(hlo_text: str) -> int:
  """Bytes of the largest ``transpose`` or ``copy`` result in an optimized HLO module
  (fused computations included): a layout change of a whole cache shows up here."""
  best = 0
  for dtype, dims in _COPY.findall(hlo_text):
    size = _HLO_BYTES.get(dtype, 4)
    for d in filter(None, dims.split(",")):
      size *= int(d)
    best = max(best, size)
  return best


def _load_cases(path: str) -> dict:
  spec = importlib.util.spec_from_file_location("fdecode_compile_cases", path)
  module = importlib.util.module_from_spec(spec)
  sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
  spec.loader.exec_module(module)
  return module.CASES


def _worker(target_name: str, cases_path: str) -> None:
  """Compiles each case name read from stdin (a line each, until it closes), one JSON line
  each (``START`` before, ``RESULT`` after)."""
  cases = _load_cases(cases_path)
  target = Target(target_name).load()
  for name in (line.strip() for line in sys.stdin):
    if not name:
      continue
    print("START " + name, flush=True)
    try:
      report = compile_one(target, cases[name])
    except Exception as e:  # pylint: disable=broad-except
      report = dict(ok=False, error=f"{type(e).__name__}: {str(e)[-3000:]}",
                    trace=traceback.format_exc()[-2000:])
    print("RESULT " + json.dumps(dict(name=name, **report)), flush=True)


def run_cases(target_name: str, cases_path: str, names: list[str], *, timeout: float = 900) -> dict:
  """Compiles every case for one target in worker processes, one at a time; returns
  name -> report (`run_targets` with one target and one lane)."""
  return run_targets(cases_path, {target_name: names}, lanes=1, timeout=timeout)[target_name]


def _worker_env() -> dict:
  # Workers of several TPU targets run at once; libtpu's lockfile would refuse all but one.
  return dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3", ALLOW_MULTIPLE_LIBTPU_LOAD="1")


def _serve(target_name: str, cases_path: str, take, timeout: float) -> dict:
  """Compiles the names ``take()`` hands out (None: no more) for one target in a worker
  process that reads them from its stdin; returns name -> report. A worker that dies or
  passes ``timeout`` seconds on one case fails that case (with the exit status and the end
  of its stderr); a new worker takes the next."""
  results, name = {}, take()
  while name is not None:
    with tempfile.TemporaryFile("w+") as err:
      proc = subprocess.Popen([sys.executable, "-m", "fdecode.devtools.compile_check", target_name, cases_path],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                              env=_worker_env())
      while name is not None:
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        try:
          proc.stdin.write(name + "\n")
          proc.stdin.flush()
          report = None
          for line in proc.stdout:
            if line.startswith("RESULT "):
              report = json.loads(line[7:])
              break
        except BrokenPipeError:
          report = None
        finally:
          timer.cancel()
        if report is None:  # the worker died (or was killed) compiling ``name``
          break
        del report["name"]
        results[name] = report
        name = take()
      try:
        proc.stdin.close()  # the worker's stdin ends: it exits
      except BrokenPipeError:
        pass
      rc = proc.wait()
      proc.stdout.close()
      if name is not None:
        err.seek(0)
        tail = err.read()[-3000:]
        results[name] = dict(ok=False, error=f"compile worker died (exit {rc}) compiling {name}: {tail}")
        name = take()
  return results


def run_targets(cases_path: str, names: dict[str, list[str]], *, lanes: int = 2, timeout: float = 900) -> dict:
  """Every target's cases (target -> its case names), compiled by ``lanes`` workers at a
  time (one per core); returns target -> name -> report.

  Each target's names form a queue. A lane takes the target with the most names left and
  starts a worker for it, which compiles that queue's names one at a time, so both lanes
  may serve one target; when the queue empties the lane moves on. The lanes end within
  one case of each other (fixed halves of each target left one lane idle for up to a
  minute: the targets' compiles take 124-350 s; 2026-11-28, 2 cores)."""
  queues = {t: collections.deque(ns) for t, ns in names.items()}
  out = {t: {} for t in names}
  lock = threading.Lock()

  def take(t):
    with lock:
      return queues[t].popleft() if queues[t] else None

  def lane():
    while True:
      with lock:
        left = [t for t in queues if queues[t]]
        if not left:
          return
        target = max(left, key=lambda t: len(queues[t]))
      done = _serve(target, cases_path, functools.partial(take, target), timeout)
      with lock:
        out[target].update(done)

  with concurrent.futures.ThreadPoolExecutor(lanes) as pool:
    for f in [pool.submit(lane) for _ in range(lanes)]:
      f.result()
  return out


if __name__ == "__main__":
  _worker(sys.argv[1], sys.argv[2])
