"""fdecode: FlashDecode attention for LLM decoding in JAX."""

from fdecode.api import flash_decode
from fdecode.combine import merge_states
from fdecode.config import Config

__all__ = ["Config", "flash_decode", "merge_states"]
__version__ = "0.1.0"
