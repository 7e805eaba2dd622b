"""``te.ops.Reshape``: ``torch.reshape`` as an operation."""

from __future__ import annotations

from typing import Iterable

from ..op import BasicOperation

__all__ = ["Reshape"]


class Reshape(BasicOperation):
    """``y = x.reshape(shape)``; one dimension may be -1 (inferred).

    Parameters
    ----------
    shape : iterable of int
    """

    def __init__(self, shape: Iterable[int]):
        super().__init__()
        try:
            dims = tuple(shape)
        except TypeError:
            raise TypeError(f"te.ops.Reshape: shape must be an iterable of ints, "
                            f"got {shape!r}") from None
        if not all(isinstance(d, int) and not isinstance(d, bool) for d in dims) \
                or sum(d == -1 for d in dims) > 1 or any(d < -1 for d in dims):
            raise ValueError(f"te.ops.Reshape: shape must be ints >= 0 with at most one -1, "
                             f"got {shape!r}")
        self._shape = dims

    def native_forward(self, x, extra_inputs, kwargs):
        return x.reshape(*self._shape), [()]

    def extra_repr(self) -> str:
        return f"shape={self._shape}"
