"""`Operand`: one kernel input as every Pallas kernel family here declares it, the array a
``pallas_call`` is given with its BlockSpec. Each family's operands are a NamedTuple of
them, declared once by name, and its ``flatten`` turns that into the call's operands
(`fdecode.kernels.triton.operands`, `fdecode.kernels.mosaic_tpu.operands`)."""

from __future__ import annotations

from typing import Any, NamedTuple


class Operand(NamedTuple):
  """One kernel input.

  Attributes:
    array: what the pallas_call is given.
    spec: its BlockSpec. On TPU, None: scalar-prefetched (SMEM, whole).
    buffer: on TPU, for an operand left in HBM (``pl.BlockSpec(memory_space=pl.ANY)``)
      that the kernel DMAs itself: its VMEM scratch (``pltpu.VMEM``); else None.
  """
  array: Any
  spec: Any = None
  buffer: Any = None
