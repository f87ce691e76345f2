"""KV cache formats: paged layout helpers, cache writes, and the host-side page allocator."""

from fdecode.cache.paged import gather_pages, gather_scale
from fdecode.cache.write import write_contiguous, write_paged
from fdecode.cache.allocator import PageAllocator, PoolExhaustedError

__all__ = ["PageAllocator", "PoolExhaustedError", "gather_pages", "gather_scale",
           "write_contiguous", "write_paged"]
