"""``te.ops.Identity``: returns its input."""

from __future__ import annotations

from ..op import BasicOperation

__all__ = ["Identity"]


class Identity(BasicOperation):
    """``y = x`` (a placeholder operation; gradients pass through unchanged)."""

    def native_forward(self, x, extra_inputs, kwargs):
        return x, [()]
