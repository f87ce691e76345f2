"""`ragged_decode`'s step on the Triton kernels (GPU, or interpreted): the decode part
(each live sequence's last row, T = 1) and the prefill blocks (T = tb rows of one
sequence) run in *one* split launch, each part's work items on its own balanced schedule
(`fdecode.kernels.triton.split_states_merged`; q rows, table rows and contiguous cache rows
read in place through a `RowSource`), and one combine launch merges both parts' states
into the step's packed rows (`fdecode.kernels.triton.step.combine_step`): two kernels
where there were four and an XLA select over the whole output.

The parts are the ones `fdecode.ragged.decode` describes; both take the balanced schedule
(a contiguous cache's decode part too, reading its sequences through the source's cache
rows), so their states are laid out alike and merge in one launch.
"""

from __future__ import annotations

from fdecode.api import canonical_call
from fdecode.dispatch import compute_dtype, triton_plan_view
from fdecode.kernels.triton import split_states_merged
from fdecode.kernels.triton.step import StepRows, combine_step
from fdecode.ragged.checks import CALLER


def _part(part: dict, *, interpret: bool, options: dict):
  """One part's balanced split: ``(plan, its split_states arguments, canonical sinks)``."""
  part = dict(part)
  c = canonical_call(part.pop("q"), part.pop("k"), part.pop("v"), part.pop("ends"), **part, **options)
  cd = compute_dtype(c.q4.dtype, *(None if x is None else x.dtype for x in (c.view.k, c.view.v, c.view.k_rope)))
  p, rv = triton_plan_view(c.q4, c.view, compute=cd, mods=c.mods, v_head_dim=c.v_head_dim, cfg=c.cfg,
                           interpret=interpret, has_sinks=c.sinks is not None, source=c.source, balance=True)
  if not p.balanced:  # `ragged_decode` sends only calls the schedule takes
    raise AssertionError(f"{CALLER}: the Triton step's plan is not balanced: {p}")
  arrays = dict(softmax_scale=c.softmax_scale, alibi=c.mod_arrays["alibi"], sinks=c.sinks, source=c.source,
                **rv.kernel_arrays())
  return (p, c.q4, c.ends, rv.k, rv.v, arrays), c.sinks


def triton_step(decode: dict, prefill: dict, rows: StepRows, *, interpret: bool, options: dict):
  """The step's packed ``(out [N, Hq, Dv] in q's dtype, lse f32 [N, Hq])``, N the packed
  rows of the parts' `RowSource`.

  ``decode`` / ``prefill``: each part's call as `fdecode.api.flash_decode_with_source`
  takes it (``q`` the gather of its rows ``[B, T, Hq, Dk]``, ``k``, ``v``, ``ends`` int32
  ``[B]``, ``block_tables`` (paged), ``source`` the `RowSource` its rows are read through,
  the cache's scales / offsets / ``k_rope``); ``rows``: where the states go (`StepRows`),
  the decode part's B = M sequences and the prefill part's B = NB blocks in order;
  ``options``: the step's other `flash_decode` keywords (modifiers but a mask or bias,
  sinks, ``v_head_dim``, ``block_k``, ``kv_layout``, ...)."""
  options = {n: x for n, x in options.items() if n not in ("num_splits", "interpret")}
  dec, sinks = _part(decode, interpret=interpret, options=options)
  pre, _ = _part(prefill, interpret=interpret, options=options)
  (o_d, l_d), (o_p, l_p) = split_states_merged([dec, pre])
  n_rows = decode["source"].q.shape[0]
  return combine_step(dec[0].combine_plan, pre[0].combine_plan, (o_d, l_d, dec[2]), (o_p, l_p, pre[2]), rows, sinks,
                      num_rows=n_rows)
