"""TE's activations with a per-row scale, the middle operation of a grouped expert MLP:
``ScaledSwiGLU``, ``ScaledSiTUGLU``, ``ScaledClampedQGeGLU`` and ``ScaledSReLU``.

Each takes one extra input, ``scales``, and returns ``act(x) * scales[..., None]``: the
router probabilities of a Mixture-of-Experts layer applied before FC2. The activation
is the one of the unscaled operation of the same family (module/activations.py,
`situglu`), then the product is taken in the dtype promotion of the two and cast to
the input's dtype: what Megatron-LM's unfused expert MLP computes with a TE activation
followed by ``* probs``, so the two give the same bits. Gradients (of the input and of
the scales) are autograd's of that formula.
"""

from __future__ import annotations

from typing import Optional

import torch

from ...module.activations import activate
from ...utils import check_bool
from ..op import BasicOperation
from .activation import check_activation_input, check_interleave_size, deinterleave
from .swiglu import check_real, situglu

__all__ = ["ScaledActivation", "ScaledSwiGLU", "ScaledSiTUGLU", "ScaledClampedQGeGLU",
           "ScaledSReLU"]


def row_scales(api: str, scales, x: torch.Tensor) -> torch.Tensor:
    """``scales`` shaped to multiply ``x``'s rows: one per row (any shape with that many
    elements, TE's being ``x.shape[:-1]``), or a single one for every row."""
    if not torch.is_tensor(scales) or not scales.is_floating_point():
        raise TypeError(f"{api}: scales (the extra input) must be a floating-point tensor, got "
                        f"{getattr(scales, 'dtype', type(scales).__name__)}")
    rows = x.shape[:-1]
    if scales.numel() == rows.numel():
        return scales.reshape(*rows, 1)
    if scales.numel() == 1:
        return scales.reshape([1] * x.dim())
    raise ValueError(f"{api}: scales must hold one value per row of the input "
                     f"({tuple(rows)}), or one for all, got shape {tuple(scales.shape)}")


class ScaledActivation(BasicOperation):
    """``act(x) * scales[..., None]`` with ``scales`` the next extra input."""

    num_extra_inputs = 1
    gated = True
    glu_interleave_size: Optional[int] = None

    def __init__(self, glu_interleave_size: Optional[int] = None, *,
                 activation_recompute_in_mlp: bool = False):
        super().__init__()
        api = f"te.ops.{type(self).__name__}"
        recompute = check_bool(api, "activation_recompute_in_mlp", activation_recompute_in_mlp)
        if recompute and self.gated:
            raise ValueError(f"{api} does not support activation recomputation in the fused "
                             "grouped MLP (activation_recompute_in_mlp must be False)")
        self.activation_recompute_in_mlp = recompute
        if glu_interleave_size is not None and not self.gated:
            raise ValueError(f"{api}: glu_interleave_size applies to gated activations only")
        self.glu_interleave_size = check_interleave_size(api, glu_interleave_size)

    def _activate(self, x: torch.Tensor) -> torch.Tensor:
        """The unscaled activation of ``x`` (contiguous halves when gated)."""
        raise NotImplementedError(f"{type(self).__name__}: _activate is not implemented")

    def native_forward(self, x, extra_inputs, kwargs):
        api = f"te.ops.{type(self).__name__}"
        check_activation_input(api, x, self.gated, self.glu_interleave_size)
        scales = row_scales(api, extra_inputs[0][0], x)
        act = self._activate(deinterleave(x, self.glu_interleave_size))
        return (act * scales).to(x.dtype), [()]


class ScaledSwiGLU(ScaledActivation):
    """``silu(a) * b * scales`` of the halves ``a, b`` of the last dimension.

    Parameters
    ----------
    glu_interleave_size : int, optional
        TE's block-interleaved layout of the halves (`te.ops.SwiGLU`).
    activation_recompute_in_mlp : bool, default False
        Must be False (TE's fused kernels do not recompute a GLU).
    """

    def _activate(self, x):
        return activate(x, "swiglu")


class ScaledSiTUGLU(ScaledActivation):
    """`te.ops.SiTUGLU` times ``scales``.

    Parameters
    ----------
    glu_interleave_size, activation_recompute_in_mlp : as for `ScaledSwiGLU`
    beta1, beta2 : float, default 4.0 and 25.0
        The soft caps (finite and positive).
    """

    def __init__(self, glu_interleave_size: Optional[int] = None, *,
                 activation_recompute_in_mlp: bool = False, beta1: float = 4.0,
                 beta2: float = 25.0):
        super().__init__(glu_interleave_size,
                         activation_recompute_in_mlp=activation_recompute_in_mlp)
        self.beta1 = check_real("te.ops.ScaledSiTUGLU", "beta1", beta1, positive=True)
        self.beta2 = check_real("te.ops.ScaledSiTUGLU", "beta2", beta2, positive=True)

    def _activate(self, x):
        return situglu(x, self.beta1, self.beta2)


class ScaledClampedQGeGLU(ScaledActivation):
    """`te.ops.ClampedSwiGLU` (a clamped quick-GELU GLU) times ``scales``.

    Parameters
    ----------
    glu_interleave_size, activation_recompute_in_mlp : as for `ScaledSwiGLU`
    limit : float, default 7.0
    alpha : float, default 1.702
    glu_linear_offset : float, default 1.0
    """

    def __init__(self, glu_interleave_size: Optional[int] = None, *,
                 activation_recompute_in_mlp: bool = False, limit: float = 7.0,
                 alpha: float = 1.702, glu_linear_offset: float = 1.0):
        super().__init__(glu_interleave_size,
                         activation_recompute_in_mlp=activation_recompute_in_mlp)
        api = "te.ops.ScaledClampedQGeGLU"
        self.limit = check_real(api, "limit", limit)
        self.alpha = check_real(api, "alpha", alpha)
        self.glu_linear_offset = check_real(api, "glu_linear_offset", glu_linear_offset)

    def _activate(self, x):
        return activate(x, "clamped_swiglu", {"limit": self.limit, "alpha": self.alpha,
                                              "glu_linear_offset": self.glu_linear_offset})


class ScaledSReLU(ScaledActivation):
    """``relu(x)**2 * scales`` (Megatron-LM's weighted squared ReLU).

    Parameters
    ----------
    activation_recompute_in_mlp : bool, default False
        Accepted (TE's fused kernels may recompute the activation); the computation is
        the same either way.
    """

    gated = False

    def __init__(self, *, activation_recompute_in_mlp: bool = False):
        super().__init__(activation_recompute_in_mlp=activation_recompute_in_mlp)

    def _activate(self, x):
        return activate(x, "srelu")
