"""Loops over a model (`fdecode.models`): greedy `generate` (`fdecode.decoding.generate`),
beam search and parallel sampling over shared pages (`fdecode.decoding.beam`), and the
continuous-batching `Engine` (`fdecode.decoding.serving`)."""
