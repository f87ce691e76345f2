"""The chips fdecode sizes its kernels for, and which one a trace is lowering for.

A kernel's tiles and launch grid come from the target's numbers (SMs, shared memory,
registers, compute capability; TensorCores and VMEM), never from one GPU's constants.
The numbers below are NVIDIA's published limits as XLA's GPU target configs record them
(``xla/backends/gpu/target_config/specs/``); `gpu_target_config` writes them in that
proto's text form so the compile tier (`fdecode.devtools.compile_check`) can compile for a GPU
this host does not have.

`lowering_gpu` answers "which GPU is this trace for": the device kind of the mesh set
with ``jax.set_mesh`` (a deviceless compile), else the local GPU, else an H100.
`tpu_lowering` does the same for Pallas' Mosaic TPU lowering: the mesh's TPU, else the
host's, else a TPU v5e (`DEFAULT_TPU`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import jax


@dataclasses.dataclass(frozen=True)
class Gpu:
  """One CUDA GPU's limits (per SM unless named per block)."""
  name: str                      # device_kind as JAX reports it
  arch: str                      # ptxas -arch
  capability: tuple              # (major, minor)
  sms: int
  smem_per_block: int            # opt-in maximum of one program (bytes)
  smem_per_sm: int
  bandwidth: float               # HBM bytes / s
  regs_per_sm: int = 65536
  threads_per_sm: int = 2048
  max_programs_per_sm: int = 32
  # XLA's cost model reads these (fusion decisions); left 0, it fuses almost nothing.
  clock_ghz: float = 0.0
  fpus_per_sm: int = 0
  l2_bytes: int = 0
  memory_bytes: int = 0

  @property
  def native_fp8(self) -> bool:
    """Whether the chip converts float8 in hardware (Ada / Hopper, sm_89+): Triton
    refuses float8 conversions below that and the kernel decodes the bits itself."""
    return self.capability >= (8, 9)

  def resident_programs(self, *, threads: int, regs: int, smem: int) -> int:
    """Programs of one kernel an SM holds at once, by threads, registers and shared memory
    (registers are allocated per warp in units of 256)."""
    warps = threads // 32
    regs_per_warp = -(-max(regs, 1) * 32 // 256) * 256
    by_regs = self.regs_per_sm // (regs_per_warp * warps)
    by_threads = self.threads_per_sm // threads
    by_smem = self.smem_per_sm // smem if smem else self.max_programs_per_sm
    return max(0, min(by_regs, by_threads, by_smem, self.max_programs_per_sm))


H100 = Gpu(name="NVIDIA H100 80GB HBM3", arch="sm_90a", capability=(9, 0), sms=132,
           smem_per_block=232448, smem_per_sm=233472, bandwidth=3.35e12,
           clock_ghz=1.98, fpus_per_sm=128, l2_bytes=50 << 20, memory_bytes=80 << 30)
# H200: the H100's SMs and shared memory, HBM3e at 4.8 TB/s (141 GB).
H200 = Gpu(name="NVIDIA H200", arch="sm_90a", capability=(9, 0), sms=132,
           smem_per_block=232448, smem_per_sm=233472, bandwidth=4.8e12,
           clock_ghz=1.98, fpus_per_sm=128, l2_bytes=50 << 20, memory_bytes=141 << 30)
A100 = Gpu(name="NVIDIA A100-SXM4-80GB", arch="sm_80", capability=(8, 0), sms=108,
           smem_per_block=166912, smem_per_sm=167936, bandwidth=2.04e12,
           clock_ghz=1.41, fpus_per_sm=64, l2_bytes=40 << 20, memory_bytes=80 << 30)
GPUS = {"h100": H100, "a100": A100}
# Chips known by their device kind (the compile tier compiles for GPUS only).
KNOWN_GPUS = (H100, H200, A100)


@dataclasses.dataclass(frozen=True)
class Tpu:
  """One TPU generation: its topology name for a deviceless compile and its numbers."""
  name: str
  topology: str                  # jax.experimental.topologies name (2x2: 1x1 is refused)
  bandwidth: float               # HBM bytes / s per chip
  cores_per_chip: int            # TensorCores a "parallel" grid axis spreads over (megacore)


TPUS = {
    "v5e": Tpu("TPU v5 lite", "v5e:2x2", 8.19e11, 1),
    "v6e": Tpu("TPU v6 lite", "v6e:2x2", 1.64e12, 1),
    "v5p": Tpu("TPU v5", "v5p:2x2x1", 2.76e12, 2),
    "v4": Tpu("TPU v4", "v4:2x2x1", 1.2e12, 2),
}
# The TPU a Mosaic kernel is lowered for when neither the trace nor the host names one (a
# ``jax.export(..., platforms=["tpu"])`` from a CPU or GPU host): `tpu_lowering`.
DEFAULT_TPU = TPUS["v5e"]


def gpu_target_config(gpu: Gpu) -> str:
  """``stream_executor.GpuTargetConfigProto`` text for ``topologies.get_topology_desc``."""
  major, minor = gpu.capability
  extension = "ACCELERATED_FEATURES" if gpu.arch.endswith("a") else "NONE"
  return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {gpu.smem_per_sm}
  threads_per_core_limit: {gpu.threads_per_sm}
  core_count: {gpu.sms}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(gpu.bandwidth)}
  shared_memory_per_block_optin: {gpu.smem_per_block}
  cuda_compute_capability {{ major: {major} minor: {minor} feature_extension: {extension} }}
  registers_per_core_limit: {gpu.regs_per_sm}
  registers_per_block_limit: 65536
  clock_rate_ghz: {gpu.clock_ghz}
  fpus_per_core: {gpu.fpus_per_sm}
  l2_cache_size: {gpu.l2_bytes}
  device_memory_size: {gpu.memory_bytes}
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 1 patch: 0 }}
device_description_str: "{gpu.name}"
"""


def _known_gpu(kind: str) -> Gpu | None:
  for gpu in KNOWN_GPUS:
    if kind == gpu.name or kind.split()[:2] == gpu.name.split()[:2] or kind.startswith(gpu.name.split("-")[0]):
      return gpu
  return None


def _gpu_from_device(kind: str, capability: tuple, sms: int) -> Gpu:
  """A GPU JAX reports but the table lacks: its SMs and capability, the shared memory of
  the closest known generation (sm_86 / sm_89 consumer parts: 99 KiB a block)."""
  known = _known_gpu(kind)
  if known is not None:
    return dataclasses.replace(known, sms=sms or known.sms)
  base = H100 if capability >= (9, 0) else A100
  if capability in ((8, 6), (8, 7), (8, 9)):
    base = dataclasses.replace(base, smem_per_block=101376, smem_per_sm=102400)
  major, minor = capability
  return dataclasses.replace(base, name=kind, arch=f"sm_{major}{minor}", capability=capability,
                             sms=sms or base.sms)


# The platform `tracing_for` names (`fdecode.plan(platform=)`), else None.
_TRACING_FOR = contextvars.ContextVar("fdecode_tracing_for", default=None)


@contextlib.contextmanager
def tracing_for(platform: str | None):
  """Inside, `lowering_platform` is ``platform`` (None: as outside): `fdecode.plan`
  traces for the platform it is asked about, whatever the host."""
  token = _TRACING_FOR.set(platform)
  try:
    yield
  finally:
    _TRACING_FOR.reset(token)


def lowering_platform() -> str:
  """The platform the current trace is for, as far as a trace can tell: the one
  `tracing_for` names, else the device platform of the mesh set with ``jax.set_mesh``
  (deviceless compiles; a CUDA export from a host without a GPU sets one), else
  `jax.default_backend` (``"cpu"``, ``"gpu"``, ``"tpu"``). A kernel that compiles for one
  platform only (``impl="mosaic_gpu"``) refuses others with it at trace time."""
  if _TRACING_FOR.get() is not None:
    return _TRACING_FOR.get()
  device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  platform = getattr(device, "platform", None)
  return platform if platform else jax.default_backend()


def lowering_gpu() -> Gpu:
  """The GPU the current trace lowers for.

  Order: the device kind of the mesh set by ``jax.set_mesh`` (deviceless compiles and
  explicit-mesh programs), then the first local GPU, then `H100` (a cross-platform
  export from a host without one).
  """
  device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  if device is not None and getattr(device, "platform", None) == "gpu":
    known = _known_gpu(device.device_kind)
    cores = getattr(device, "num_cores", None) or 0
    if known is not None:
      return dataclasses.replace(known, sms=cores or known.sms)
  try:
    local = jax.devices("gpu")[0]
  except RuntimeError:
    return H100
  cc = tuple(int(x) for x in str(getattr(local, "compute_capability", "9.0")).split("."))
  return _gpu_from_device(local.device_kind, cc, int(getattr(local, "core_count", 0) or 0))


@contextlib.contextmanager
def tpu_lowering():
  """Inside, Pallas lowers a Mosaic TPU kernel for the TPU this trace is for, on any host.

  Pallas reads the chip it lowers for from the device of the abstract mesh in context, else
  from the host's default device, and refuses a device that is not a TPU ("Unsupported TPU
  device kind: cpu"). That device is kept when it is a TPU (an export inside
  ``jax.sharding.use_abstract_mesh`` with a TPU `jax.sharding.AbstractDevice`, a deviceless
  compile, a TPU host). Outside any mesh, `DEFAULT_TPU` (TPU v5e) is set as the device of the
  empty abstract mesh: a plain ``jax.export(..., platforms=["tpu"])`` from a CPU or GPU host
  lowers the kernel for a v5e (fdecode's TPU plans do not depend on the generation; for
  another chip, export inside ``use_abstract_mesh`` with its device kind). Inside a mesh of
  other devices (``sharded_flash_decode`` over ``jax.make_mesh`` on a CPU host) no chip can
  stand in, since that mesh is part of every array's type there: Pallas' refusal is raised
  as a ValueError that shows the abstract-mesh recipe.
  """
  mesh = jax.sharding.get_abstract_mesh()
  device = getattr(mesh, "abstract_device", None)
  default = jax.config.jax_default_device  # a device, a platform name, or None
  platform = device.platform if device is not None else (getattr(default, "platform", default) or jax.default_backend())
  if platform == "tpu":
    yield
    return
  if mesh.empty:
    tpu = jax.sharding.AbstractDevice(device_kind=DEFAULT_TPU.name, num_cores=DEFAULT_TPU.cores_per_chip,
                                      platform="tpu")
    with jax.sharding.use_abstract_mesh(mesh.update(abstract_device=tpu)):
      yield
    return
  try:
    yield
  except ValueError as e:
    if "Unsupported TPU device kind" not in str(e):
      raise
    devices = f"{platform} devices" if device is not None else f"unnamed devices on a {platform} host"
    raise ValueError(
        f"fdecode: cannot lower the Mosaic TPU kernel inside a mesh of {devices} "
        f"(mesh.shape={dict(mesh.shape)}): Pallas lowers for the TPU the mesh's device names. "
        "Export with an abstract mesh of the TPU devices, passed as sharded_flash_decode's mesh= "
        "and set around the export: mesh = jax.sharding.AbstractMesh("
        f"{tuple(mesh.axis_sizes)}, {tuple(mesh.axis_names)}, abstract_device=jax.sharding.AbstractDevice("
        f"device_kind={DEFAULT_TPU.name!r}, num_cores={DEFAULT_TPU.cores_per_chip}, platform='tpu')); "
        "with jax.sharding.use_abstract_mesh(mesh): jax.export(jax.jit(f), platforms=['tpu'])(...)") from e
