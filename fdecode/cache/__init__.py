"""KV cache formats: paged layout helpers, cache writes, and the host-side page allocator
(reference counts, forks and copy-on-write)."""

from fdecode.cache.paged import gather_pages, gather_scale
from fdecode.cache.write import copy_pages, write_contiguous, write_paged
from fdecode.cache.allocator import PageAllocator, PoolExhaustedError, UnknownSequenceError

__all__ = ["PageAllocator", "PoolExhaustedError", "UnknownSequenceError", "copy_pages",
           "gather_pages", "gather_scale", "write_contiguous", "write_paged"]
