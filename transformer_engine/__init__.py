"""A pure-PyTorch implementation of Transformer Engine's PyTorch FP8 training API."""

__version__ = "0.1.0"
