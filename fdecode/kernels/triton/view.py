"""A canonical call's Triton plan and the view of the cache its kernels read (`plan_view`),
for a decode (`fdecode.kernels.triton.backend`) and a ragged step's parts
(`fdecode.kernels.triton.ragged_step`)."""

from __future__ import annotations

from fdecode.cache.layout import QUANT_ARRAYS
from fdecode.kernels.triton.plan import TritonPlan, make_plan


def plan_view(q, view, *, compute, mods, v_head_dim, cfg, interpret, has_mask_or_bias=False,
              has_sinks=False, index_slots=None, sparse_fold=1, source=None, balance=None, step=None):
  """The Triton kernels' plan of a canonical call (q ``[B, T, Hq, Dq]``, its cache ``view``)
  and the view they read (its read layout; a `RowSource`'s whole
  contiguous caches where the plan reads cache rows). ``balance`` None: ``cfg.balance``;
  ``step``: a ragged step's part (`fdecode.kernels.triton.make_plan`)."""
  rv = view.read(view.read_layout)
  p = make_plan(q.shape, rv.k, rv.v, compute_dtype=compute, out_dtype=q.dtype, kv_layout=rv.layout,
                block_tables=rv.block_tables, k_rope=rv.k_rope,
                **{n: getattr(rv, n) for n in QUANT_ARRAYS}, v_head_dim=v_head_dim, mods=mods,
                has_mask_or_bias=has_mask_or_bias, has_sinks=has_sinks, index_slots=index_slots,
                sparse_fold=sparse_fold, num_splits=cfg.num_splits, block_k=cfg.block_k,
                balance=cfg.balance if balance is None else balance, interpret=interpret, source=source,
                step=step, split_size=cfg.invariant_split)
  return p, read_view(p, view, source)


def read_view(p: TritonPlan, view, source):
  """The view plan ``p`` reads: ``view`` in its read layout, or a `RowSource`'s whole caches."""
  rv = view.read(view.read_layout)
  if p.cache_source:  # the whole contiguous caches the call's are gathers of, read at the source's rows
    rv = source.caches.read(rv.layout)
  return rv
