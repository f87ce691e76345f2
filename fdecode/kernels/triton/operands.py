"""A kernel's operands declared once, by name: a NamedTuple of `Operand` s (None where a
call has none, tuples where a field holds several), flattened by `flatten` into the
``pallas_call`` operands and BlockSpecs, and rebuilt in the kernel from its refs by
`take` in the same field order, so the kernel reads each ref by the name it was given.
"""

from __future__ import annotations

import jax
from jax.experimental import pallas as pl

from fdecode.kernels.common.operands import Operand


def whole(x) -> Operand:
  """``x`` as one block, the same for every program (of a grid of any rank)."""
  return Operand(x, pl.BlockSpec(x.shape, lambda *ids: (0,) * x.ndim))


def flatten(operands) -> tuple[list, list, jax.tree_util.PyTreeDef]:
  """A named structure of `Operand` s -> ``(arrays, specs, layout)``: the arrays and their
  BlockSpecs in field order (absent ones skipped) and the layout `take` rebuilds it by."""
  leaves, layout = jax.tree_util.tree_flatten(operands, is_leaf=lambda x: isinstance(x, Operand))
  return [x.array for x in leaves], [x.spec for x in leaves], layout


def take(layout: jax.tree_util.PyTreeDef, refs):
  """A kernel's refs -> ``(inputs, outputs)``: the first ``layout.num_leaves`` refs as the
  structure `flatten` made the layout from (a ref where it had an operand, None where
  not), and the rest."""
  n = layout.num_leaves
  return jax.tree_util.tree_unflatten(layout, refs[:n]), refs[n:]
