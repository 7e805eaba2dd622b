"""The multi-tensor operations, with TE's names and calling convention
``op(chunk_size, noop_flag, tensor_lists, *args)`` (through `multi_tensor_applier`).

NOTE [Multi-tensor paths]
    CUDA tensors of float32, float16 or bfloat16 take the Triton kernels of
    `kernels/multi_tensor.py`: one launch per dtype signature of the lists, whatever the
    number of tensors (NOTE [Chunk table]). Everything else (CPU tensors, float64) takes
    the torch ops below, written with ``torch._foreach_*`` so a list costs a few ops, not
    a few per tensor. Both do the same float32 arithmetic in the same order (float64
    when a tensor is float64), so they agree bit for bit, except the sums of squares of
    the L2 norm, which are summed in another order (relative difference within 1e-5).
    ``noop_flag`` (an int32 tensor) is set to 1 where TE sets it: by `multi_tensor_scale`
    on a non-finite input, by `multi_tensor_l2norm` on a non-finite sum of squares. The
    capturable Adam and SGD skip their update while it is set; the other Adam steps
    ignore it (they propagate non-finite values, as TE's do).
"""

from __future__ import annotations

import struct
from collections import defaultdict
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..kernel_config import get_kernel_config, load_kernels
from ..quantize import _INTERPRETER, FP8_DTYPES, cast_to_fp8, current_scale, fp8_max

__all__ = ["multi_tensor_scale", "multi_tensor_scale_tensor", "multi_tensor_l2norm",
           "multi_tensor_unscale_l2norm", "multi_tensor_adam",
           "multi_tensor_adam_param_remainder", "multi_tensor_adam_fp8",
           "multi_tensor_adam_capturable", "multi_tensor_adam_capturable_master",
           "multi_tensor_sgd", "multi_tensor_compute_scale_and_scale_inv"]

_kernels = None     # kernels.multi_tensor once imported; False where Triton is missing
_SMALL = (torch.float32, torch.float16, torch.bfloat16)


def _kernels_for(lists) -> Optional[object]:
    """The Triton kernels module if these lists take the fused path (NOTE [Multi-tensor
    paths]), else None."""
    global _kernels
    first = lists[0][0]
    config = get_kernel_config()
    if not ((first.is_cuda or (_INTERPRETER and config.interpret)) and config.fused) \
            or torch.compiler.is_compiling():
        return None
    for lst in lists:
        for t in lst:
            if t.dtype not in _SMALL + (torch.int16,) or not t.is_contiguous() \
                    or t.device != first.device:
                return None
    if _kernels is None:
        _kernels = (load_kernels("multi_tensor") or (False,))[0]
    return _kernels or None


def _by_signature(lists) -> List[List[List[torch.Tensor]]]:
    """The lists split by the dtypes of their tensors at each index (one launch each)."""
    groups: Dict[tuple, List[int]] = defaultdict(list)
    for i in range(len(lists[0])):
        groups[tuple(lst[i].dtype for lst in lists)].append(i)
    return [[[lst[i] for i in idx] for lst in lists] for idx in groups.values()]


def _f32(x: float) -> float:
    """``x`` rounded to float32 (the constants of the float32 arithmetic)."""
    return struct.unpack("f", struct.pack("f", float(x)))[0]


def _math_dtype(lists) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for lst in lists for t in lst) \
        else torch.float32


def _set_flag(noop_flag: torch.Tensor, bad: torch.Tensor) -> None:
    noop_flag.masked_fill_(bad.reshape(()).to(noop_flag.device), 1)


def _check_lists(name: str, lists, counts: Sequence[int]) -> None:
    if len(lists) not in counts:
        raise ValueError(f"{name}: tensor_lists must hold {' or '.join(map(str, counts))} "
                         f"lists, got {len(lists)}")
    if any(len(lst) != len(lists[0]) for lst in lists):
        raise ValueError(f"{name}: the tensor lists must have the same length, got "
                         f"{[len(lst) for lst in lists]}")


# ---- scale --------------------------------------------------------------------------

def _scale(chunk_size, noop_flag, tensor_lists, scale, scale_tensor, name):
    _check_lists(name, tensor_lists, (2,))
    for group in _by_signature(tensor_lists):
        kernels = _kernels_for(group)
        if kernels is not None and group[0][0].dtype in kernels.DTYPES \
                and group[1][0].dtype in kernels.DTYPES:
            kernels.scale_(group, chunk_size, noop_flag, scale, scale_tensor)
            continue
        math = _math_dtype(group)
        src = [t.to(math) for t in group[0]]
        factor = scale_tensor.to(math).reshape(()) if scale_tensor is not None else (
            scale if math == torch.float64 else _f32(scale))
        torch._foreach_copy_(group[1], torch._foreach_mul(src, factor))
        peaks = torch._foreach_norm(src, float("inf"))
        _set_flag(noop_flag, ~torch.isfinite(torch.stack(peaks)).all())


def multi_tensor_scale(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, scale: float):
    """``out = in * scale`` for ``tensor_lists = [ins, outs]`` (in place where they are
    the same tensors; a copy where ``scale`` is 1); ``noop_flag = 1`` if an input is not
    finite."""
    _scale(chunk_size, noop_flag, tensor_lists, float(scale), None, "multi_tensor_scale")


def multi_tensor_scale_tensor(chunk_size: int, noop_flag: torch.Tensor, tensor_lists,
                              scale: torch.Tensor):
    """`multi_tensor_scale` with the scale in a one-element float32 tensor (no host
    synchronization: Megatron's gradient clipping passes its clip coefficient so)."""
    if not isinstance(scale, torch.Tensor) or scale.numel() != 1:
        raise TypeError("multi_tensor_scale_tensor: scale must be a one-element tensor, got "
                        f"{type(scale).__name__}")
    scale = scale.to(device=tensor_lists[0][0].device, dtype=torch.float32).reshape(1)
    _scale(chunk_size, noop_flag, tensor_lists, 1.0, scale, "multi_tensor_scale_tensor")


# ---- L2 norm ------------------------------------------------------------------------

def _l2norm(chunk_size, noop_flag, tensor_lists, per_tensor, inv_scale, name):
    _check_lists(name, tensor_lists, (1,))
    tensors = tensor_lists[0]
    device = tensors[0].device
    sums = torch.empty(len(tensors), dtype=torch.float32, device=device)
    kernels = _kernels_for(tensor_lists)
    if kernels is not None and all(t.dtype in kernels.DTYPES for t in tensors):
        scale = None if inv_scale is None else \
            inv_scale.to(device=device, dtype=torch.float32).reshape(1)
        bad = torch.zeros((), dtype=torch.bool, device=device)
        index = {id(t): i for i, t in enumerate(tensors)}
        for (group,) in _by_signature(tensor_lists):
            partial, table = kernels.sum_squares(group, chunk_size, scale)
            local = torch.zeros(len(group), dtype=torch.float32, device=device)
            local.index_add_(0, table.tensor_of_chunk, partial)
            where = torch.tensor([index[id(t)] for t in group], device=device)
            sums.index_copy_(0, where, local)
            bad = bad | ~torch.isfinite(partial).all()
    else:
        math = _math_dtype(tensor_lists)
        src = [t.to(math) for t in tensors]
        if inv_scale is not None:
            src = torch._foreach_mul(src, inv_scale.to(device=device, dtype=math).reshape(()))
        norms = torch.stack(torch._foreach_norm(src, 2.0))
        sums.copy_(norms * norms)
        bad = ~torch.isfinite(norms).all()
    _set_flag(noop_flag, bad)
    norm = sums.sum().sqrt().reshape(1)
    per = sums.sqrt() if per_tensor else torch.empty(0, dtype=torch.float32, device=device)
    return norm, per


def multi_tensor_l2norm(chunk_size: int, noop_flag: torch.Tensor, tensor_lists,
                        per_tensor: Optional[bool] = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """The L2 norm of all tensors of ``tensor_lists = [tensors]`` together, as a float32
    tensor of one element, and (``per_tensor``) each tensor's, else an empty tensor;
    ``noop_flag = 1`` if a sum of squares is not finite."""
    return _l2norm(chunk_size, noop_flag, tensor_lists, bool(per_tensor), None,
                   "multi_tensor_l2norm")


def multi_tensor_unscale_l2norm(chunk_size: int, noop_flag: torch.Tensor, tensor_lists,
                                inv_scale: torch.Tensor, per_tensor: Optional[bool] = False):
    """`multi_tensor_l2norm` of the tensors times ``inv_scale`` (a one-element tensor)."""
    return _l2norm(chunk_size, noop_flag, tensor_lists, bool(per_tensor), inv_scale,
                   "multi_tensor_unscale_l2norm")


# ---- Adam ---------------------------------------------------------------------------

def _sqrt(xs: List[torch.Tensor]) -> List[torch.Tensor]:
    """Correctly rounded square roots (torch's vectorized float32 CPU ``sqrt`` is not:
    it misses by an ulp now and then; through float64 the float32 result is exact)."""
    if xs and xs[0].dtype == torch.float32:
        return [r.float() for r in torch._foreach_sqrt([x.double() for x in xs])]
    return torch._foreach_sqrt(xs)


def _adam_math(g, p, m, v, c, adamw: bool):
    """One Adam step on lists of tensors of the math dtype (new lists); ``c``: beta1,
    beta2, 1 - beta1, 1 - beta2, bc1, bc2, eps, lr, decay (numbers or tensors)."""
    beta1, beta2, omb1, omb2, bc1, bc2, eps, lr, decay = c
    f = torch._foreach_mul
    if not adamw:
        g = torch._foreach_add(g, f(p, decay))
    m = torch._foreach_add(f(m, beta1), f(g, omb1))
    v = torch._foreach_add(f(v, beta2), f(f(g, omb2), g))
    denom = torch._foreach_add(_sqrt(torch._foreach_div(v, bc2)), eps)
    update = torch._foreach_div(torch._foreach_div(m, bc1), denom)
    if adamw:
        update = torch._foreach_add(update, f(p, decay))
    return torch._foreach_sub(p, f(update, lr)), m, v


def _join_remainder(params: List[torch.Tensor], rems: List[torch.Tensor]) -> List[torch.Tensor]:
    """float32 masters from bfloat16 params and their int16 low halves (the param was
    rounded half away from zero, so a negative low half means the high half went up)."""
    out = []
    for p, r in zip(params, rems):
        hi = p.view(torch.int16).to(torch.int32)
        lo = r.to(torch.int32)
        hi = torch.where(lo < 0, hi - 1, hi)
        out.append(((hi << 16) | (lo & 0xFFFF)).view(torch.float32))
    return out


def _split_remainder(masters, params, rems) -> None:
    for w, p, r in zip(masters, params, rems):
        bits = w.view(torch.int32)
        lo = (bits & 0xFFFF).to(torch.int16)
        hi = bits >> 16
        hi = torch.where(lo < 0, hi + 1, hi)
        r.copy_(lo)
        p.view(torch.int16).copy_(hi.to(torch.int16))


def _adam_constants(lr, beta1, beta2, eps, step, bias_correction, weight_decay, math):
    bc1 = 1.0 - beta1 ** step if bias_correction else 1.0
    bc2 = 1.0 - beta2 ** step if bias_correction else 1.0
    c = (beta1, beta2, 1.0 - beta1, 1.0 - beta2, bc1, bc2, eps, lr, weight_decay)
    return c if math == torch.float64 else tuple(_f32(x) for x in c)


def _adam(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, eps, step, mode,
          bias_correction, weight_decay, remainder, name):
    _check_lists(name, tensor_lists, (4, 5))
    if remainder and len(tensor_lists) != 5:
        raise ValueError(f"{name}: needs 5 lists (grads, bf16 params, exp_avgs, exp_avg_sqs, "
                         "int16 remainders)")
    for group in _by_signature(tensor_lists):
        math = _math_dtype(group)
        c = _adam_constants(float(lr), float(beta1), float(beta2), float(eps), int(step),
                            bool(bias_correction), float(weight_decay), math)
        kernels = _kernels_for(group)
        if kernels is not None:
            kernels.adam_(group, chunk_size, noop_flag, c, bool(mode), remainder, None)
            continue
        g, p, m, v = ([t.to(math) for t in lst] for lst in group[:4])
        if remainder:
            w = _join_remainder(group[1], group[4])
        else:
            w = [t.to(math) for t in group[4]] if len(group) == 5 else p
        w, m, v = _adam_math(g, w, m, v, c, bool(mode))
        torch._foreach_copy_(group[2], m)
        torch._foreach_copy_(group[3], v)
        if remainder:
            _split_remainder(w, group[1], group[4])
            continue
        if len(group) == 5:
            torch._foreach_copy_(group[4], w)
        torch._foreach_copy_(group[1], w)


def multi_tensor_adam(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, lr: float,
                      beta1: float, beta2: float, epsilon: float, step: int, mode: int,
                      bias_correction: int, weight_decay: float):
    """One Adam step in place. ``tensor_lists``: grads, params, exp_avgs, exp_avg_sqs
    and, optionally, float32 master params (then the params receive the rounded
    masters). ``mode`` 1: decoupled weight decay (AdamW), 0: L2 added to the grad."""
    _adam(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, epsilon, step, mode,
          bias_correction, weight_decay, False, "multi_tensor_adam")


def multi_tensor_adam_param_remainder(chunk_size: int, noop_flag: torch.Tensor, tensor_lists,
                                      lr: float, beta1: float, beta2: float, epsilon: float,
                                      step: int, mode: int, bias_correction: int,
                                      weight_decay: float):
    """`multi_tensor_adam` with float32 masters kept as bfloat16 params (list 1) plus
    the int16 low halves of the masters' bits (list 4)."""
    _adam(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, epsilon, step, mode,
          bias_correction, weight_decay, True, "multi_tensor_adam_param_remainder")


def multi_tensor_adam_fp8(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, lr: float,
                          beta1: float, beta2: float, epsilon: float, step: int, mode: int,
                          bias_correction: int, weight_decay: float,
                          fp8_dtype: Optional[torch.dtype] = None):
    """`multi_tensor_adam` for FP8 params: lists grads, FP8 data, exp_avgs, exp_avg_sqs,
    float32 masters, scales, amaxes, scale_invs. Each FP8 data gets
    ``fp8(clamp(master * scale))`` (saturating), its amax the max with ``max|master|``,
    its scale_inv ``1 / scale``. Torch ops (one per tensor for the casts)."""
    _check_lists("multi_tensor_adam_fp8", tensor_lists, (8,))
    g, data, m, v, w, scales, amaxes, scale_invs = tensor_lists
    _adam(chunk_size, noop_flag, [g, [x.float() for x in w], m, v, w], lr, beta1, beta2,
          epsilon, step, mode, bias_correction, weight_decay, False, "multi_tensor_adam_fp8")
    for d, master, s, a, si in zip(data, w, scales, amaxes, scale_invs):
        dtype = fp8_dtype or (d.dtype if d.is_floating_point() else torch.float8_e4m3fn)
        q = cast_to_fp8(master, s.reshape(1).float(), dtype)
        d.copy_(q.data if d.dtype == dtype else q.data.view(d.dtype))
        a.copy_(torch.maximum(a, master.abs().amax().to(a.dtype)))
        si.copy_(s.reciprocal())


def _adam_capturable(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, eps, step, mode,
                     bias_correction, weight_decay, inv_scale, name, counts):
    """Adam with lr, step and the loss scale in device tensors: no host synchronization,
    the grads unscaled in place, nothing updated while ``noop_flag`` is set."""
    _check_lists(name, tensor_lists, counts)
    device = tensor_lists[0][0].device
    step_f = step.to(device=device, dtype=torch.float32).reshape(())
    ones = torch.ones((), dtype=torch.float32, device=device)
    if bias_correction:
        bc1 = 1 - torch.pow(torch.full((), _f32(beta1), device=device), step_f)
        bc2 = 1 - torch.pow(torch.full((), _f32(beta2), device=device), step_f)
    else:
        bc1 = bc2 = ones
    lr_t = lr.to(device=device, dtype=torch.float32).reshape(())
    inv = inv_scale.to(device=device, dtype=torch.float32).reshape(())
    scalars = torch.stack([lr_t, bc1, bc2, inv])
    for group in _by_signature(tensor_lists):
        c = [_f32(beta1), _f32(beta2), _f32(1.0 - beta1), _f32(1.0 - beta2), 1.0, 1.0,
             _f32(eps), 1.0, _f32(weight_decay)]
        kernels = _kernels_for(group)
        if kernels is not None and _math_dtype(group) == torch.float32:
            kernels.adam_(group, chunk_size, noop_flag, c, bool(mode), False, scalars)
            continue
        math = _math_dtype(group)
        keep = (noop_flag.reshape(()) == 0).to(device)
        g = torch._foreach_mul([t.to(math) for t in group[0]], scalars[3].to(math))
        p, m, v = ([t.to(math) for t in lst] for lst in group[1:4])
        w = [t.to(math) for t in group[4]] if len(group) == 5 else p
        c[4], c[5], c[7] = scalars[1].to(math), scalars[2].to(math), scalars[0].to(math)
        new_w, new_m, new_v = _adam_math(g, w, m, v, c, bool(mode))
        outs = [(group[0], g), (group[2], new_m), (group[3], new_v), (group[1], new_w)]
        if len(group) == 5:
            outs.append((group[4], new_w))
        for dst, src in outs:
            for d, s in zip(dst, src):
                d.copy_(torch.where(keep, s.to(d.dtype), d))


def multi_tensor_adam_capturable(chunk_size: int, noop_flag: torch.Tensor, tensor_lists,
                                 lr: torch.Tensor, beta1: float, beta2: float, epsilon: float,
                                 step: torch.Tensor, mode: int, bias_correction: int,
                                 weight_decay: float, inv_scale: torch.Tensor):
    """`multi_tensor_adam` (4 lists) with ``lr`` and ``step`` device tensors and the
    grads multiplied by ``inv_scale`` first; skipped while ``noop_flag`` is set."""
    _adam_capturable(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, epsilon, step,
                     mode, bias_correction, weight_decay, inv_scale,
                     "multi_tensor_adam_capturable", (4,))


def multi_tensor_adam_capturable_master(chunk_size: int, noop_flag: torch.Tensor, tensor_lists,
                                        lr: torch.Tensor, beta1: float, beta2: float,
                                        epsilon: float, step: torch.Tensor, mode: int,
                                        bias_correction: int, weight_decay: float,
                                        inv_scale: torch.Tensor):
    """`multi_tensor_adam_capturable` with float32 master params (list 4)."""
    _adam_capturable(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, epsilon, step,
                     mode, bias_correction, weight_decay, inv_scale,
                     "multi_tensor_adam_capturable_master", (5,))


# ---- SGD ----------------------------------------------------------------------------

def multi_tensor_sgd(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, wd: float,
                     momentum: float, dampening: float, lr: float, nesterov: bool,
                     first_run: bool, wd_after_momentum: bool, scale: float):
    """One SGD step in place (skipped while ``noop_flag`` is set). ``tensor_lists``:
    grads, params, momentum buffers and, optionally, copies of the params to write
    (float16 model weights of float32 masters). The grad is multiplied by ``scale``
    first; ``first_run`` sets the buffers to the grads, as torch.optim.SGD's first step
    does; weight decay is added before the momentum, or after with
    ``wd_after_momentum``."""
    _check_lists("multi_tensor_sgd", tensor_lists, (3, 4))
    for group in _by_signature(tensor_lists):
        math = _math_dtype(group)
        r = (lambda x: x) if math == torch.float64 else _f32
        wd_, mom, omd, lr_, sc = (r(x) for x in (wd, momentum, 1.0 - dampening, lr, scale))
        kernels = _kernels_for(group)
        if kernels is not None:
            kernels.sgd_(group, chunk_size, noop_flag, wd_, mom, omd, lr_, nesterov, first_run,
                         wd_after_momentum, sc)
            continue
        if bool(noop_flag.reshape(-1)[0] != 0):
            return
        f = torch._foreach_mul
        g = f([t.to(math) for t in group[0]], sc)
        p = [t.to(math) for t in group[1]]
        if wd != 0 and not wd_after_momentum:
            g = torch._foreach_add(g, f(p, wd_))
        if momentum != 0:
            m = g if first_run else torch._foreach_add(
                f([t.to(math) for t in group[2]], mom), f(g, omd))
            g = torch._foreach_add(g, f(m, mom)) if nesterov else m
            torch._foreach_copy_(group[2], m)
        if wd != 0 and wd_after_momentum:
            g = torch._foreach_add(g, f(p, wd_))
        p = torch._foreach_add(p, f(g, -lr_))
        torch._foreach_copy_(group[1], p)
        if len(group) == 4:
            torch._foreach_copy_(group[3], p)


# ---- FP8 scales ---------------------------------------------------------------------

def multi_tensor_compute_scale_and_scale_inv(chunk_size: int, noop_flag: torch.Tensor,
                                             tensor_lists, max_fp8: float,
                                             force_pow_2_scales: bool = False,
                                             epsilon: float = 0.0):
    """Current-scaling scales from amaxes, ``tensor_lists = [amaxes, scales, scale_invs]``
    (float32, element by element): ``scale = max_fp8 / max(amax, epsilon)`` (1 where
    that amax is 0 or not finite, at most the float32 maximum, rounded down to a power
    of two with ``force_pow_2_scales``) and ``scale_inv = 1 / scale``, the arithmetic
    of `quantize.current_scale`. ``max_fp8``: 448 (E4M3) or 57344 (E5M2)."""
    name = "multi_tensor_compute_scale_and_scale_inv"
    _check_lists(name, tensor_lists, (3,))
    dtypes = {fp8_max(d): d for d in FP8_DTYPES}
    if float(max_fp8) not in dtypes:
        raise ValueError(f"{name}: max_fp8 must be an FP8 format's largest value "
                         f"{sorted(dtypes)}, got {max_fp8}")
    amaxes, scales, scale_invs = tensor_lists
    if any(t.dtype != torch.float32 for lst in tensor_lists for t in lst):
        raise TypeError(f"{name}: the amaxes, scales and scale_invs must be float32 tensors")
    flat = torch.cat([a.reshape(-1) for a in amaxes])
    scale = current_scale(flat, dtypes[float(max_fp8)], bool(force_pow_2_scales), float(epsilon))
    pieces = scale.split([a.numel() for a in amaxes])
    torch._foreach_copy_(scales, [p.view(s.shape) for p, s in zip(pieces, scales)])
    inverses = torch.reciprocal(scale).split([a.numel() for a in amaxes])
    torch._foreach_copy_(scale_invs, [p.view(s.shape) for p, s in zip(inverses, scale_invs)])
