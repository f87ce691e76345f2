"""`ragged_decode`'s step on the Triton kernels (GPU, or interpreted): the decode part
(each live sequence's last row, T = 1) and the prefill blocks (T = tb rows of one
sequence) run in *one* split launch, each part's work items on its own balanced schedule
(`fdecode.kernels.triton.split_states_merged`), and one combine launch merges both parts'
states into the step's packed rows (`fdecode.kernels.triton.step.combine_step`): two
kernels where there were four, an XLA select over the whole output, and the XLA fusions
that computed each part's geometry. Every program derives its unit's geometry (sequence,
rows, kv length, the part's schedule) from the step's ``cu``, ``kv_lens`` and
``num_seqs`` (`fdecode.kernels.triton.geometry`); q rows, table rows and contiguous cache
rows are read in place.

The parts are the ones `fdecode.ragged.decode` describes; both take the balanced schedule
(a contiguous cache's decode part too, reading its sequences through the source's
caches), so their states are laid out alike and merge in one launch.
"""

from __future__ import annotations

from fdecode.call import Call
from fdecode.dispatch import compute_dtype, triton_plan_view
from fdecode.kernels.mosaic_gpu import takes_mla
from fdecode.kernels.triton import StepPart, combine_step, merges_parts, split_states, split_states_merged
from fdecode.ragged.checks import CALLER


def _part(c: Call, step: StepPart, *, interpret: bool):
  """One part's balanced split: ``(plan, its split_states arguments, canonical sinks)``."""
  cd = compute_dtype(c.q4.dtype, *(None if x is None else x.dtype for x in (c.view.k, c.view.v, c.view.k_rope)))
  p, rv = triton_plan_view(c.q4, c.view, compute=cd, mods=c.mods, v_head_dim=c.v_head_dim, cfg=c.cfg,
                           interpret=interpret, has_sinks=c.sinks is not None, source=c.source, balance=True,
                           has_mask_or_bias=c.mod_arrays["mask"] is not None or c.mod_arrays["bias"] is not None,
                           step=step)
  if not p.balanced:  # `ragged_decode` sends only calls the schedule takes
    raise AssertionError(f"{CALLER}: the Triton step's plan is not balanced: {p}")
  arrays = dict(softmax_scale=c.softmax_scale, alibi=c.mod_arrays["alibi"], sinks=c.sinks, source=c.source,
                **rv.kernel_arrays())
  return (p, c.q4, c.ends, rv.k, rv.v, arrays), c.sinks


def hopper_takes_decode_part(c: Call) -> bool:
  """Whether `flash_decode`'s compiled GPU dispatch sends the decode part (``c``: the
  step's call, `fdecode.ragged.parts.with_call`) to the Hopper MLA kernel (`fdecode.kernels.mosaic_gpu.takes_mla`: an sm_90 GPU lowered for, bf16
  latents of one contiguous head, G a multiple of 16, no modifiers): the step then keeps
  the two-part path, the decode part on that kernel (2-8x the Triton kernel's speed, H200)."""
  m = c.mod_arrays
  return takes_mla(c.q4, c.view.read(c.view.read_layout), c.mods, c.sinks, None, c.v_head_dim, m["mask"],
                   m["bias"], m["alibi"], c.cfg)


def triton_step(decode: Call, prefill: Call, step, *, block: int, capacity: int, interpret: bool):
  """The step's packed ``(out [N, Hq, Dv] in q's dtype, lse f32 [N, Hq])``.

  ``decode`` / ``prefill``: each part's canonical call (`fdecode.ragged.parts.triton_calls`):
  ``q4`` ``[B, T, Hq, Dk]`` (for its shape: a gather of the part's rows, never read),
  ``ends`` int32 ``[B]`` (likewise), the cache view (the part's table rows when paged), the
  canonical modifiers (a per-row mask / bias: gathers, for their form), sinks and options,
  and ``source``: the `RowSource` its rows are read through, with ``step``: ``(cu,
  kv_lens, num_seqs)`` (int32 ``[M + 1]`` clipped non-decreasing, ``[M]``, ``[1]``), the
  arrays every unit's geometry derives from, and the step's own per-row mask / bias. The
  decode part's B is M sequences, the prefill part's the NB blocks of ``block`` rows;
  ``capacity``: S. The knobs' ``num_splits`` is None (the schedule is balanced) and
  ``interpret`` is the step's."""
  n_rows, m = decode.source.q.shape[0], decode.q4.shape[0]
  parts = [StepPart(part=name, rows=n_rows, seqs=m, units=c.q4.shape[0], block=tb, seq_len=capacity)
           for name, c, tb in (("decode", decode, 1), ("prefill", prefill, block))]
  dec, sinks = _part(decode, parts[0], interpret=interpret)
  pre, _ = _part(prefill, parts[1], interpret=interpret)
  if merges_parts():  # one launch for both parts' work items
    decode_states, prefill_states = split_states_merged([dec, pre])
  else:  # (A100: the merged kernel spilled; `fdecode.kernels.triton.plan.MERGE_PARTS_CAPABILITY`)
    decode_states, prefill_states = (split_states(p, q, ends, k, v, **arrays) for p, q, ends, k, v, arrays in (dec, pre))
  return combine_step(dec[0], pre[0], decode_states, prefill_states, step, sinks)
