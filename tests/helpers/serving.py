"""The tiny model the serving tests run (`fdecode.decoding.serving.Engine`)."""

from fdecode.models.base import ModelConfig


CFG = ModelConfig(vocab=97, dim=64, layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=96)
