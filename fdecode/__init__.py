"""fdecode: FlashDecode attention for LLM decoding in JAX."""

from fdecode.api import flash_decode
from fdecode.cascade import cascade_decode
from fdecode.combine import apply_sinks, combine_across, merge_states
from fdecode.config import Config
from fdecode.ragged import ragged_decode
from fdecode.sharding import sharded_flash_decode

__all__ = ["Config", "apply_sinks", "cascade_decode", "combine_across", "flash_decode", "merge_states", "ragged_decode", "sharded_flash_decode"]
__version__ = "0.1.0"
