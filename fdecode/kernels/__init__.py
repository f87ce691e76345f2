"""FlashDecode partial-state producers: the Pallas kernel and the plain-XLA path.

Both take the canonical row layout and return per-split states
``o: f32[B, Hkv, n_splits, R, Dv]``, ``lse: f32[B, Hkv, n_splits, R]`` that
`fdecode.combine.merge_states` combines along axis 2.
"""
