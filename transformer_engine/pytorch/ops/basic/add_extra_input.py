"""``te.ops.AddExtraInput``: adds a tensor passed to the fuser beside the input (a
residual connection)."""

from __future__ import annotations

from ...utils import check_bool
from ..op import BasicOperation

__all__ = ["AddExtraInput"]


class AddExtraInput(BasicOperation):
    """``y = x + extra`` where ``extra`` is the next extra input of the
    `te.ops.Sequential` call. Both get the output gradient.

    Parameters
    ----------
    in_place : bool, default False
        TE writes the sum into ``extra``'s storage. Accepted; here the sum is always
        a new tensor, which autograd's version checks would otherwise forbid for a
        tensor saved elsewhere (the values are the same).
    """

    num_extra_inputs = 1

    def __init__(self, *, in_place: bool = False):
        super().__init__()
        self._in_place = check_bool("te.ops.AddExtraInput", "in_place", in_place)

    def native_forward(self, x, extra_inputs, kwargs):
        (extra,) = extra_inputs[0]
        if extra.shape != x.shape:
            raise ValueError(f"te.ops.AddExtraInput: the extra input's shape {tuple(extra.shape)} "
                             f"must equal the input's {tuple(x.shape)}")
        return x + extra, [()]
