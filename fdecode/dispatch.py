"""The one backend dispatch of `flash_decode`: the call as every backend takes it
(`fdecode.kernels.backend.Decode`), run on the backend `fdecode.route` chooses for the
platform being lowered for, and its states finished one way (the split states merged, the
rows put back in the output's shape, sinks applied). Arguments arrive validated and
canonical (`fdecode.call`)."""

from __future__ import annotations

import contextlib
import functools

import jax

from fdecode.combine import apply_sinks, merge_states
from fdecode.kernels import backend as backend_lib
from fdecode.kernels.backend import Decode, Operands, Options, States
from fdecode import derivatives
from fdecode import route


@contextlib.contextmanager
def recording_plans():
  """Inside, each backend plan traced, and each refusal before it, appends ``(platform,
  plan)`` to the list it yields (`fdecode.plan`); a jitted `decode` must then be traced
  anew (`recording`)."""
  with backend_lib.recording_log() as log, route.every_branch():  # every platform's branch traced now
    yield log


recording = backend_lib.recording


@functools.partial(jax.jit, static_argnames=("options",))
def decode(operands: Operands, *, options: Options):
  """``operands`` (`fdecode.kernels.backend.Operands`: q ``[B, T, Hq, Dk]``, its cache view,
  ends, index lists, modifier arrays, sinks, a `RowSource`) with ``options``
  (`fdecode.kernels.backend.Options`) -> (out ``[B, T, Hq, Dv]`` in q.dtype, lse f32
  ``[B, T, Hq]``).

  The one dispatch: its backend per platform *lowered for* (`fdecode.route.run_decode`),
  so exporting for TPU or CUDA from a CPU host embeds that platform's kernel.
  Differentiable in every float argument, forward and reverse mode
  (`fdecode.derivatives`: the forward runs this kernel, the tangent plain XLA).
  """
  return derivatives.differentiable(_forward, options, operands)


def _forward(operands: Operands, options: Options):
  """`decode`'s forward: its backend, by the platform lowered for."""
  q = operands.q
  b, t, hq, _ = q.shape
  hkv = operands.view.kv_heads

  def finish(states: States, operands: Operands):  # the branch's operands
    if states.merged:  # the backend finished the output itself
      return states.o, states.lse
    if states.lse.shape[2] == 1:  # one split: its state is the merge (merge_states of one part is exact)
      o, lse = states.o[:, :, 0], states.lse[:, :, 0]
    else:
      o, lse = merge_states(states.o, states.lse, axis=2)  # [B, Hkv, R, Dv], [B, Hkv, R]
    dv = o.shape[-1]
    out = o.reshape(b, hkv, t, hq // hkv, dv).transpose(0, 2, 1, 3, 4).reshape(b, t, hq, dv)
    lse = lse.reshape(b, hkv, t, hq // hkv).transpose(0, 2, 1, 3).reshape(b, t, hq)
    if operands.sinks is not None:  # once, after every split is merged
      out, lse = apply_sinks(out, lse, operands.sinks)
    return out.astype(q.dtype), lse

  return route.run_decode(Decode(options, operands), finish)
