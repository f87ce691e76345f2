"""`ragged_decode`: a serving step's packed, ragged new tokens in one attention call
(`fdecode.ragged.decode`), its two parts (`fdecode.ragged.parts`) on the Triton kernels
in two launches (`fdecode.kernels.triton.triton_step`), with its fused cache write
(`fdecode.ragged.write`) and its argument checks (`fdecode.ragged.checks`)."""

from fdecode.ragged.decode import ragged_decode, row_positions
from fdecode.ragged.parts import QUERY_BLOCK

__all__ = ["QUERY_BLOCK", "ragged_decode", "row_positions"]
