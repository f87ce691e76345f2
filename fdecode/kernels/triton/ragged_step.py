"""`fdecode.ragged_decode`'s step on the Triton kernels (GPU, or interpreted): the decode part
(each live sequence's last row, T = 1) and the prefill blocks (T = tb rows of one
sequence) run in *one* split launch, each part's work items on its own balanced schedule
(`fdecode.kernels.triton.split_states_merged`), and one combine launch merges both parts'
states into the step's packed rows (`fdecode.kernels.triton.step.combine_step`): two
kernels where there were four, an XLA select over the whole output, and the XLA fusions
that computed each part's geometry. Every program derives its unit's geometry (sequence,
rows, kv length, the part's schedule) from the step's ``cu``, ``kv_lens`` and
``num_seqs`` (`fdecode.kernels.triton.geometry`); q rows, table rows and contiguous cache
rows are read in place.

The parts are the ones `fdecode.ragged.decode` describes, each a
`fdecode.kernels.backend.Decode` (`fdecode.ragged.parts.step_calls`); both take the balanced schedule
(a contiguous cache's decode part too, reading its sequences through the source's
caches), so their states are laid out alike and merge in one launch.
"""

from __future__ import annotations

from fdecode.kernels.backend import Decode, note
from fdecode.kernels.triton.geometry import StepPart
from fdecode.kernels.triton.plan import merges_parts
from fdecode.kernels.triton.split import Arrays, split_states, split_states_merged
from fdecode.kernels.triton.step import combine_step
from fdecode.kernels.triton.view import plan_view


def _part(c: Decode, step: StepPart, *, interpret: bool):
  """One part's balanced split: ``(plan, its split_states arguments, canonical sinks)``."""
  o, x = c.options, c.operands
  m = x.mod_arrays
  p, rv = plan_view(x.q, x.view, compute=c.compute_dtype, mods=o.mods, v_head_dim=o.v_head_dim, cfg=o.cfg,
                    interpret=interpret, has_sinks=x.sinks is not None, source=x.source, balance=True,
                    has_mask_or_bias=m["mask"] is not None or m["bias"] is not None, step=step)
  note(p)
  if not p.balanced:  # `ragged_decode` sends only calls the schedule takes
    raise AssertionError(f"ragged_decode: the Triton step's plan is not balanced: {p}")
  arrays = Arrays(**rv.kernel_arrays(), alibi=m["alibi"], sinks=x.sinks, source=x.source)
  return (p, x.q, x.ends, rv.k, rv.v, arrays, o.softmax_scale), x.sinks


def triton_step(decode: Decode, prefill: Decode, step, *, block: int, capacity: int, interpret: bool):
  """The step's packed ``(out [N, Hq, Dv] in q's dtype, lse f32 [N, Hq])``.

  ``decode`` / ``prefill``: each part's canonical call (`fdecode.ragged.parts.step_calls`):
  q ``[B, T, Hq, Dk]`` (for its shape: a gather of the part's rows, never read),
  ``ends`` int32 ``[B]`` (likewise), the cache view (the part's table rows when paged), the
  canonical modifiers (a per-row mask / bias: gathers, for their form), sinks and options,
  and ``source``: the `RowSource` its rows are read through, with ``step``: ``(cu,
  kv_lens, num_seqs)`` (int32 ``[M + 1]`` clipped non-decreasing, ``[M]``, ``[1]``), the
  arrays every unit's geometry derives from, and the step's own per-row mask / bias. The
  decode part's B is M sequences, the prefill part's the NB blocks of ``block`` rows;
  ``capacity``: S. The knobs' ``num_splits`` is None (the schedule is balanced) and
  ``interpret`` is the step's."""
  n_rows, m = decode.operands.source.q.shape[0], decode.operands.q.shape[0]
  parts = [StepPart(part=name, rows=n_rows, seqs=m, units=c.operands.q.shape[0], block=tb, seq_len=capacity)
           for name, c, tb in (("decode", decode, 1), ("prefill", prefill, block))]
  dec, sinks = _part(decode, parts[0], interpret=interpret)
  pre, _ = _part(prefill, parts[1], interpret=interpret)
  if merges_parts():  # one launch for both parts' work items
    decode_states, prefill_states = split_states_merged([dec, pre])
  else:  # (A100: the merged kernel spilled; `fdecode.kernels.triton.plan.MERGE_PARTS_CAPABILITY`)
    decode_states, prefill_states = (split_states(p, q, ends, k, v, arrays, softmax_scale=scale)
                                     for p, q, ends, k, v, arrays, scale in (dec, pre))
  return combine_step(dec[0], pre[0], decode_states, prefill_states, step, sinks)
