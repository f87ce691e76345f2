"""fdecode: FlashDecode attention for LLM decoding in JAX.

The entry points: `flash_decode` (new tokens over a KV cache), `ragged_decode` (a serving
step's packed new tokens), `cascade_decode` (shared prefixes), `sharded_flash_decode`
(over a mesh), `plan` (what a call would run), and the state merges `merge_states`,
`combine_across`, `apply_sinks`. Caches: `fdecode.cache`; Flax: `fdecode.flax`; models and
serving: `fdecode.models`, `fdecode.decoding`.
"""

from fdecode.api import flash_decode, plan
from fdecode.cascade import cascade_decode
from fdecode.combine import apply_sinks, combine_across, merge_states
from fdecode.ragged import ragged_decode
from fdecode.sharding import sharded_flash_decode

__all__ = ["apply_sinks", "cascade_decode", "combine_across", "flash_decode", "merge_states", "plan", "ragged_decode",
           "sharded_flash_decode"]
__version__ = "0.1.0"
