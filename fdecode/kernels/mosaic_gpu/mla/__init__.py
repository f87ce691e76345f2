"""The Hopper MLA kernel family: `plan` (`MlaPlan`, `mla_plan`, `unsupported`), `kernel`
(the three-warpgroup kernel, `mla_states` / `mla_partials`) and `api` (`mla_decode`,
`mla_run`). Import them from `fdecode.kernels.mosaic_gpu`."""
