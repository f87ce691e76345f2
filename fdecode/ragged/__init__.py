"""`ragged_decode`: a serving step's packed, ragged new tokens in one attention call
(`fdecode.ragged.decode`), with its fused cache write (`fdecode.ragged.write`) and its
argument checks (`fdecode.ragged.checks`)."""

from fdecode.ragged.decode import QUERY_BLOCK, ragged_decode, row_positions

__all__ = ["QUERY_BLOCK", "ragged_decode", "row_positions"]
