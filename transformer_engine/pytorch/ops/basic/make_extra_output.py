"""``te.ops.MakeExtraOutput``: returns its input a second time, as an extra output
of the fuser (the residual branch of a pre-norm block)."""

from __future__ import annotations

from ...utils import check_bool
from ..op import BasicOperation

__all__ = ["MakeExtraOutput"]


class MakeExtraOutput(BasicOperation):
    """``y = x``, and ``x`` again as an extra output of the `te.ops.Sequential` call;
    in backward the input gradient is the sum of both gradients.

    Parameters
    ----------
    in_place : bool, default False
        TE accumulates the output gradient into the extra output's gradient in place.
        Accepted; the sum here is autograd's, with the same values.
    """

    num_extra_outputs = 1

    def __init__(self, *, in_place: bool = False):
        super().__init__()
        self._in_place = check_bool("te.ops.MakeExtraOutput", "in_place", in_place)

    def native_forward(self, x, extra_inputs, kwargs):
        return x, [(x,)]
