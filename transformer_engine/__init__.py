"""A pure-PyTorch implementation of Transformer Engine's PyTorch FP8 training API.

``__version__`` names the TE release whose PyTorch API these names follow, with the
local label ``+pure`` saying that this is the pure-PyTorch implementation, not
NVIDIA's (docs/package-identity.md). As in TE, ``import transformer_engine`` makes
``transformer_engine.common`` and ``transformer_engine.pytorch`` reachable as
attributes; importing them only defines names.
"""

__version__ = "2.9.0+pure"

from . import common, pytorch  # noqa: E402  (after __version__, which setup.py reads)

__all__ = ["__version__", "common", "pytorch"]
