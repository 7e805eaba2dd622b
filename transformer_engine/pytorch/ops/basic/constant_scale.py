"""``te.ops.ConstantScale``: multiplication by a Python number."""

from __future__ import annotations

from ..op import BasicOperation

__all__ = ["ConstantScale"]


class ConstantScale(BasicOperation):
    """``y = scale * x``; the gradient is ``scale * dy``.

    Parameters
    ----------
    scale : float
    """

    def __init__(self, scale: float):
        super().__init__()
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(f"te.ops.ConstantScale: scale must be a float, got {scale!r}")
        self.scale = float(scale)

    def native_forward(self, x, extra_inputs, kwargs):
        return x * self.scale, [()]

    def extra_repr(self) -> str:
        return f"scale={self.scale}"
