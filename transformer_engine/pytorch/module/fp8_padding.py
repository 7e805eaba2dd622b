"""te.Fp8Padding and te.Fp8Unpadding: pad each row block of a grouped-GEMM input to a
multiple of the FP8 alignment, and drop those rows again from the output.

Mixture-of-Experts layers route a token count per expert that is rarely a multiple of
what an FP8 GEMM takes (NOTE [FP8 shapes] in fp8_shapes.py); Megatron-LM's grouped
experts call ``Fp8Padding(num_gemms)(x, tokens_per_expert)`` before
`te.GroupedLinear` and ``Fp8Unpadding(num_gemms)(out, tokens_per_expert)`` after. The
added rows are zeros and their outputs are dropped, so they change no result; their
gradients are zero and never reach the input. Both are torch ops (split, zero rows,
cat), differentiable as such, with TE's signatures.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from ..utils import check_positive_int
from .grouped_linear import check_m_splits

__all__ = ["Fp8Padding", "Fp8Unpadding", "DEFAULT_ALIGN_SIZE"]

DEFAULT_ALIGN_SIZE = 16
"""The alignment when none is given: what the per-tensor FP8 recipes' CUDA GEMM needs
(TE pads to 32 only for MXFP8, which is not implemented here)."""


def _padded(splits: Sequence[int], align: int) -> List[int]:
    return [-(-m // align) * align for m in splits]


class _Alignment(torch.nn.Module):
    """What padding and unpadding share: ``num_gemms`` and ``align_size``."""

    api = ""

    def __init__(self, num_gemms: int, align_size: Optional[int] = None):
        super().__init__()
        self.num_gemms = check_positive_int(self.api, "num_gemms", num_gemms)
        self.align_size = (DEFAULT_ALIGN_SIZE if align_size is None
                           else check_positive_int(self.api, "align_size", align_size))

    def _check_input(self, inp) -> None:
        if not torch.is_tensor(inp) or inp.dim() == 0:
            got = f"shape {tuple(inp.shape)}" if torch.is_tensor(inp) else type(inp).__name__
            raise TypeError(f"{self.api}.forward: input must be a tensor of at least one "
                            f"dimension (rows first), got {got}")

    def extra_repr(self) -> str:
        return f"num_gemms={self.num_gemms}, align_size={self.align_size}"


class Fp8Padding(_Alignment):
    """Pad each of the ``num_gemms`` row blocks of an input (sizes ``m_splits``) with
    zero rows up to a multiple of ``align_size`` (16 when None).

    ``forward(inp, m_splits)`` returns ``(padded_inp, padded_m_splits)``; an input that
    needs no padding is returned as it is.
    """

    api = "te.Fp8Padding"

    def forward(self, inp: torch.Tensor, m_splits: Sequence[int]
                ) -> Tuple[torch.Tensor, List[int]]:
        self._check_input(inp)
        splits = check_m_splits(m_splits, self.num_gemms, inp.shape[0], self.api)
        padded = _padded(splits, self.align_size)
        if padded == splits:
            return inp, padded
        blocks = []
        for block, m, p in zip(torch.split(inp, splits), splits, padded):
            blocks.append(block)
            if p > m:
                blocks.append(inp.new_zeros((p - m, *inp.shape[1:])))
        return torch.cat(blocks), padded


class Fp8Unpadding(_Alignment):
    """Drop the rows `Fp8Padding` added: ``forward(inp, m_splits)`` takes the padded
    output and the *unpadded* block sizes, and returns the ``sum(m_splits)`` rows that
    belong to real tokens."""

    api = "te.Fp8Unpadding"

    def forward(self, inp: torch.Tensor, m_splits: Sequence[int]) -> torch.Tensor:
        self._check_input(inp)
        splits = check_m_splits(m_splits, self.num_gemms, None, self.api)
        padded = _padded(splits, self.align_size)
        if sum(padded) != inp.shape[0]:
            raise ValueError(f"{self.api}.forward: the input has {inp.shape[0]} rows, but "
                             f"m_splits={splits} padded to multiples of {self.align_size} "
                             f"give {padded} (sum {sum(padded)}); pass the block sizes "
                             "before padding")
        if padded == splits:
            return inp
        return torch.cat([block[:m] for block, m in zip(torch.split(inp, padded), splits)])
