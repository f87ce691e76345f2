"""The TPU backend (Pallas Mosaic): block sizes and VMEM (`plan`), the contiguous and paged
kernels (`kernel`), token-major reads (`token_major`) and sparse index lists (`sparse`)."""
