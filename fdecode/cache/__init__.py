"""KV cache formats: layouts, paged layout helpers, 8-bit quantization (`quantize`,
`dequantize`; the format: `fdecode.cache.quant`), cache writes, the host-side page
allocator (reference counts, forks and copy-on-write) and mesh helpers for writes."""

from fdecode.cache.paged import gather_pages, gather_scale
from fdecode.cache.write import copy_pages, write_contiguous, write_paged
from fdecode.cache.allocator import PageAllocator, PoolExhaustedError, UnknownSequenceError
from fdecode.cache.quant import dequantize, quantize

__all__ = ["PageAllocator", "PoolExhaustedError", "UnknownSequenceError", "copy_pages", "dequantize",
           "gather_pages", "gather_scale", "quantize", "write_contiguous", "write_paged"]
