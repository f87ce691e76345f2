"""The backends, one package each, each with its plan: `xla` (the plain-XLA path),
`mosaic_tpu` (Pallas Mosaic for TPU), `triton` (Pallas Triton for GPU) and `mosaic_gpu`
(Pallas Mosaic GPU for Hopper), over what they share (`common`: block math, modifiers,
index lists, chip data). Each package's ``__init__`` is its face; nothing outside imports
its modules.

The XLA and Mosaic TPU paths return per-split states ``o: f32[B, Hkv, n_splits, R, Dv]``,
``lse: f32[B, Hkv, n_splits, R]`` that `fdecode.combine.merge_states` combines along axis 2;
the Triton and Mosaic GPU paths finish the output themselves (their split kernel, then the
Triton combine kernel).
"""
