"""The package's fused operations and the fusion functions the fuser applies before
any registered one (NOTE [Fusion passes] in ops/fuser.py)."""

from .linear_chain import LinearChain, fuse_linear_chains

PACKAGE_FUSIONS = (fuse_linear_chains,)

__all__ = ["LinearChain", "fuse_linear_chains", "PACKAGE_FUSIONS"]
