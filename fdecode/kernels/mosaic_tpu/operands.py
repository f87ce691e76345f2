"""The Mosaic kernels' operands, by name.

Each kernel declares its inputs once, as a NamedTuple of `Operand` fields in the
pallas_call's order (the scalar-prefetched ones first: ``spec`` None), None where an operand is absent.
`flatten` turns it into the pallas_call's operands, BlockSpecs and DMA buffers; the kernel,
wrapped by `by_name`, gets the same NamedTuple back holding refs: one of its inputs, and
one of its DMA buffers, each under the name of the operand it holds (None for an absent
operand, and in the buffers for one that is not DMA'd).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from fdecode.kernels.common.operands import Operand


class Layout(NamedTuple):
  """What the kernel side needs to name its refs (static): the operands' NamedTuple type,
  the present operands and those with a DMA buffer, each in the type's field order."""
  kind: type
  inputs: tuple[str, ...]
  buffered: tuple[str, ...]

  def named(self, refs, names):
    """A ``kind`` holding ``refs`` under ``names``, None elsewhere."""
    given = dict(zip(names, refs))
    return self.kind(*(given.get(field) for field in self.kind._fields))


class Flat(NamedTuple):
  """A kernel's operands as the pallas_call takes them (`flatten`)."""
  arrays: tuple          # the present operands' arrays, in field order
  num_scalar_prefetch: int
  in_specs: list         # the BlockSpecs of the operands after the scalar-prefetched ones
  buffers: list          # the DMA buffers, in field order: the first scratch shapes
  layout: Layout


def flatten(operands) -> Flat:
  """``operands`` (a NamedTuple of `Operand` or None) -> the pallas_call's `Flat`."""
  present = [(name, op) for name, op in zip(operands._fields, operands) if op is not None]
  prefetch = [name for name, op in present if op.spec is None]
  if [name for name, _ in present[:len(prefetch)]] != prefetch:
    raise ValueError(f"{type(operands).__name__}: scalar-prefetched operands {prefetch} must come first")
  layout = Layout(type(operands), tuple(name for name, _ in present),
                  tuple(name for name, op in present if op.buffer is not None))
  return Flat(arrays=tuple(op.array for _, op in present), num_scalar_prefetch=len(prefetch),
              in_specs=[op.spec for _, op in present[len(prefetch):]],
              buffers=[op.buffer for _, op in present if op.buffer is not None], layout=layout)


def by_name(body: Callable, layout: Layout) -> Callable:
  """The pallas kernel ``(*refs)`` that calls ``body(ins, bufs, o_ref, lse_ref, *scratch)``
  (its statics bound, ``functools.partial``): ``ins`` the input refs and ``bufs`` the DMA
  buffers, each a ``layout.kind``
  (`Layout.named`); ``scratch`` the scratch refs after the buffers. Every Mosaic kernel
  here has two outputs, its partial outputs and LSEs."""

  def kernel(*refs):
    n, m = len(layout.inputs), len(layout.buffered)
    ins = layout.named(refs[:n], layout.inputs)
    o_ref, lse_ref = refs[n:n + 2]
    bufs = layout.named(refs[n + 2:n + 2 + m], layout.buffered)
    return body(ins, bufs, o_ref, lse_ref, *refs[n + 2 + m:])

  return kernel
