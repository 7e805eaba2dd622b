"""Which multiply-add contraction torch's CUDA tanh-GELU backward was compiled with.

Its sum ``0.5 * (1 + t) + (left * (1 - t*t)) * inner_derivative`` has a product on
each side, and nvcc contracts one of them into a fused multiply-add. This script
computes the gradient both ways in Triton (no other contraction, libdevice's tanh, as
kernels/activations.py does) and counts, over 2^22 float32 inputs, the elements each
way differs from ``torch.ops.aten.gelu_backward(approximate="tanh")`` in. The way that
differs in none is the one NOTE [Same arithmetic] must follow.

Usage (a CUDA GPU with Triton): python qa/L1_pytorch_gpu/gelu_backward_contraction.py
"""

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from transformer_engine.pytorch.kernels.activations import _CONSTANTS

BETA, KAPPA, KAPPA3 = _CONSTANTS["beta"], _CONSTANTS["kappa"], _CONSTANTS["3kappa"]


@triton.jit
def _grad(g_ptr, x_ptr, out_ptr, n, FIRST: tl.constexpr, BETA: tl.constexpr,
          KAPPA: tl.constexpr, KAPPA3: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask)
    x = tl.load(x_ptr + offs, mask=mask)
    x_sq = x * x
    t = libdevice.tanh(BETA * tl.fma(KAPPA, x_sq * x, x))
    left = 0.5 * x
    tanh_derivative = tl.fma(-t, t, 1.0)
    inner_derivative = BETA * tl.fma(KAPPA3, x_sq, 1.0)
    if FIRST:       # the first addend's product contracted
        dx = g * tl.fma(0.5, 1.0 + t, (left * tanh_derivative) * inner_derivative)
    else:           # the second addend's
        dx = g * tl.fma(left * tanh_derivative, inner_derivative, 0.5 * (1.0 + t))
    tl.store(out_ptr + offs, dx, mask=mask)


def main():
    n = 1 << 22
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.cat([torch.linspace(-10, 10, n // 2, device="cuda"),
                   torch.randn(n // 2, device="cuda", generator=gen) * 3])
    g = torch.randn(n, device="cuda", generator=gen)
    ref = torch.ops.aten.gelu_backward(g, x, approximate="tanh")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    for first in (True, False):
        out = torch.empty_like(x)
        _grad[(triton.cdiv(n, 1024),)](g, x, out, n, first, BETA, KAPPA, KAPPA3, 1024,
                                       enable_fp_fusion=False)
        differ = int((out.view(torch.int32) != ref.view(torch.int32)).sum())
        print(f"{'first' if first else 'second'} addend's product contracted: "
              f"{differ} of {n} gradients differ from torch's")


if __name__ == "__main__":
    main()
