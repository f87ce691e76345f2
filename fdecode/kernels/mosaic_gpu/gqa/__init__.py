"""The Hopper GQA rows kernel family: `plan` (`RowsPlan`, `rows_plan`, `rows_unsupported`),
`kernel` (the two-warpgroup kernel, `rows_states` / `rows_partials`), `paging` (its TMA
copies from a contiguous cache or a paged pool, and its operands) and `api`
(`rows_decode`, `rows_run`). Import them from `fdecode.kernels.mosaic_gpu`."""
