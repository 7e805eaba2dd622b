"""Rotary position embedding (RoFormer, https://arxiv.org/abs/2104.09864): TE's
``RotaryPositionEmbedding`` (the angles) and ``apply_rotary_pos_emb`` (the rotation).

NOTE [Rotary layouts]
    The angles tensor ``freqs`` is ``[s, 1, 1, d2]`` (float32): row ``p`` holds the
    angles of position ``p``, each frequency twice. Non-interleaved (the default),
    the channel pairs ``(i, i + d2/2)`` rotate together and ``freqs[p]`` is
    ``[f_0 .. f_{d2/2-1}, f_0 .. f_{d2/2-1}] * p``; interleaved, the pairs are
    ``(2i, 2i+1)`` and ``freqs[p]`` is ``[f_0, f_0, f_1, f_1, ...] * p``. A pair
    ``(a, b)`` at angle ``theta`` becomes ``(a cos - b sin, b cos + a sin)``. Only the
    first ``d2`` channels of each head rotate; the rest pass through. The rotation
    is computed in float32 and rounded once to the input's dtype.

    Positions: ``sbhd`` / ``bshd`` token ``i`` has position ``i`` (plus
    ``start_positions[b]`` when given). ``thd`` positions restart at 0 in each
    sequence of ``cu_seqlens``. With context parallelism (``cp_size > 1``) each rank
    holds two chunks of every sequence, chunks ``cp_rank`` and ``2 cp_size - 1 -
    cp_rank`` of its ``2 cp_size`` equal chunks (the load-balanced split), and its
    tokens carry those chunks' positions; a local sequence of ``n`` tokens is a
    global one of ``n * cp_size``. ``start_positions[b]`` shifts every position of
    sequence ``b``, with or without context parallelism (as TE's kernels and its
    unfused path do).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..module.params import materialize_device
from ..function_results import add_into, cast_to
from ..utils import check_choice, check_positive_int

__all__ = ["RotaryPositionEmbedding", "apply_rotary_pos_emb", "apply_fused_qkv_rotary_pos_emb",
           "ROPE_FORMATS"]

ROPE_FORMATS = ("sbhd", "bshd", "thd")


class RotaryPositionEmbedding(torch.nn.Module):
    """The rotary angles of positions ``offset .. offset + max_seq_len - 1``.

    Parameters
    ----------
    dim : int
        Rotary dimension (channels per head that rotate).
    rotary_percent : float, default 1.0
        Rotate only ``int(dim * rotary_percent)`` channels.
    seq_len_interpolation_factor : float, optional
        Position interpolation (https://arxiv.org/abs/2306.15595): positions are
        divided by it. With ``pretrained_max_position_embeddings`` too, a
        sequence longer than ``pretrained * factor`` divides positions by
        ``max_seq_len / pretrained`` instead (dynamic scaling).
    pretrained_max_position_embeddings : int, optional
    rotary_base : float, default 10000.0
        Frequency ``i`` is ``rotary_base ** (-2i / dim)``.
    interleaved : bool, default False
        The layout of NOTE [Rotary layouts].
    device : torch.device, optional
        Where ``inv_freq`` lives (CUDA when available, else CPU, when None).

    ``forward(max_seq_len, offset=0)`` returns ``freqs`` of shape
    ``[max_seq_len, 1, 1, dim]``, float32.
    """

    def __init__(self, dim: int, rotary_percent: float = 1.0,
                 seq_len_interpolation_factor: Optional[float] = None,
                 pretrained_max_position_embeddings: Optional[int] = None,
                 rotary_base: float = 10000.0, interleaved: bool = False, device=None):
        super().__init__()
        api = "te.RotaryPositionEmbedding"
        check_positive_int(api, "dim", dim)
        if (isinstance(rotary_percent, bool) or not isinstance(rotary_percent, (int, float))
                or not 0.0 < rotary_percent <= 1.0):
            raise ValueError(f"{api}: rotary_percent must be in (0, 1], got {rotary_percent!r}")
        if rotary_percent < 1.0:
            dim = int(dim * rotary_percent)
        if dim < 2 or dim % 2:
            raise ValueError(f"{api}: the rotary dimension must be an even number >= 2 (pairs of "
                             f"channels rotate), got {dim}")
        for name, v in (("seq_len_interpolation_factor", seq_len_interpolation_factor),
                        ("rotary_base", rotary_base)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                                  or not math.isfinite(v) or v <= 0):
                raise ValueError(f"{api}: {name} must be a finite positive number, got {v!r}")
        if pretrained_max_position_embeddings is not None:
            check_positive_int(api, "pretrained_max_position_embeddings",
                               pretrained_max_position_embeddings)
        self.dim, self.interleaved = dim, bool(interleaved)
        self.rotary_base = float(rotary_base)
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        self.pretrained_max_position_embeddings = pretrained_max_position_embeddings
        device = torch.device(device) if device is not None else materialize_device()
        exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim
        self.register_buffer("inv_freq", 1.0 / (self.rotary_base ** exponents))

    def forward(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        api = "te.RotaryPositionEmbedding"
        max_seq_len = _int_from_scalar_tensor(max_seq_len)     # (a host sync, as in TE)
        offset = _int_from_scalar_tensor(offset)
        check_positive_int(api, "max_seq_len", max_seq_len)
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise ValueError(f"{api}: offset must be a non-negative int, got {offset!r}")
        pos = torch.arange(max_seq_len, dtype=self.inv_freq.dtype,
                           device=self.inv_freq.device) + offset
        factor = self.seq_len_interpolation_factor
        pretrained = self.pretrained_max_position_embeddings
        if factor is not None:
            if pretrained is not None and max_seq_len > pretrained * factor:
                pos = pos * (pretrained / max_seq_len)
            else:
                pos = pos * (1.0 / factor)
        angles = torch.outer(pos, self.inv_freq)
        if self.interleaved:
            emb = angles.repeat_interleave(2, dim=-1)
        else:
            emb = torch.cat((angles, angles), dim=-1)
        return emb.reshape(max_seq_len, 1, 1, emb.shape[-1])


def _cp_positions(seqlen: int, cp_size: int, cp_rank: int, device) -> torch.Tensor:
    """The global positions of a rank's ``seqlen`` tokens under the load-balanced
    context-parallel split (NOTE [Rotary layouts])."""
    if cp_size == 1:
        return torch.arange(seqlen, device=device)
    seg = seqlen // 2
    full = seqlen * cp_size
    return torch.cat((torch.arange(cp_rank * seg, (cp_rank + 1) * seg, device=device),
                      torch.arange(full - (cp_rank + 1) * seg, full - cp_rank * seg,
                                   device=device)))


def _int_from_scalar_tensor(value):
    """A one-element integer tensor as the int it holds (TE's callers pass
    ``max_seqlen`` computed on the device); anything else unchanged."""
    if torch.is_tensor(value) and value.numel() == 1 and not value.is_floating_point() \
            and not value.is_complex() and value.dtype != torch.bool:
        return int(value.item())
    return value


def _rotate(t: torch.Tensor, angles: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate the first ``angles.shape[-1]`` channels of ``t`` (angles broadcast to
    ``t``'s leading dimensions), in float32, through `_Rotation`."""
    return _Rotation.apply(t, torch.cos(angles), torch.sin(angles), interleaved)


def _turned(v: torch.Tensor, interleaved: bool, transpose: bool) -> torch.Tensor:
    """``turn(v)``: each pair ``(a, b)`` becomes ``(-b, a)`` (pairs ``(2i, 2i+1)``
    interleaved, ``(i, i + d2/2)`` otherwise); with ``transpose``, ``turn``'s
    transpose ``(b, -a)``. One new tensor (two while dynamo traces: it cannot trace the
    strided ``out=`` writes; Inductor fuses the two)."""
    if torch.compiler.is_compiling():
        if interleaved:
            lo, hi = v[..., 0::2], v[..., 1::2]
        else:
            lo, hi = v.chunk(2, dim=-1)
        pair = (hi, -lo) if transpose else (-hi, lo)
        return (torch.stack(pair, dim=-1).flatten(-2) if interleaved
                else torch.cat(pair, dim=-1))
    out = torch.empty_like(v)
    if interleaved:
        lo, hi, o_lo, o_hi = v[..., 0::2], v[..., 1::2], out[..., 0::2], out[..., 1::2]
    else:
        half = v.shape[-1] // 2
        lo, hi, o_lo, o_hi = v[..., :half], v[..., half:], out[..., :half], out[..., half:]
    if transpose:
        o_lo.copy_(hi)
        torch.neg(lo, out=o_hi)
    else:
        torch.neg(hi, out=o_lo)
        o_hi.copy_(lo)
    return out


def _rotated(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool,
             transpose: bool = False) -> torch.Tensor:
    """On the first ``d2`` channels of ``t``, in float32: ``x cos + turn(x) sin`` (or,
    with ``transpose``, the transposed map ``x cos + turn^T(x sin)``, the gradient),
    each product and the sum rounded once, then rounded to ``t``'s dtype; the other
    channels pass through. Contiguous whatever ``t``'s strides (as TE's)."""
    d2 = cos.shape[-1]
    x = t[..., :d2].to(torch.float32)
    out = x * cos
    # the rotation's autograd function returns this: NOTE [Fresh function results] in
    # function_results.py
    if transpose:
        out = add_into(out, _turned(x * sin, interleaved, transpose=True))
    else:
        out = add_into(out, _turned(x, interleaved, transpose=False).mul_(sin))
    rotated = cast_to(out, t.dtype)
    if d2 == t.shape[-1]:
        return rotated if rotated.is_contiguous() else rotated.contiguous()
    return torch.cat((rotated, t[..., d2:]), dim=-1)


class _Rotation(torch.autograd.Function):
    """The rotation, saving only ``cos`` and ``sin`` (as TE's fused kernel does); the
    backward applies the transposed map, exact also for angles that differ within a
    pair (TE accepts any ``freqs``)."""

    @staticmethod
    def forward(ctx, t, cos, sin, interleaved):
        ctx.save_for_backward(cos, sin)
        ctx.interleaved = interleaved
        return _rotated(t, cos, sin, interleaved)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _rotated(grad, cos, sin, ctx.interleaved, transpose=True), None, None, None


def _check_int_vector(api: str, name: str, t, length: Optional[int] = None) -> torch.Tensor:
    if not torch.is_tensor(t) or t.dim() != 1 or t.is_floating_point() or t.is_complex() \
            or t.dtype == torch.bool or (length is not None and t.numel() != length):
        want = f" of length {length}" if length is not None else ""
        got = (f"{t.dtype} tensor of shape {tuple(t.shape)}" if torch.is_tensor(t)
               else type(t).__name__)
        raise ValueError(f"{api}: {name} must be a 1-D integer tensor{want}, got {got}")
    return t


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, tensor_format: str = "sbhd",
                         start_positions: Optional[torch.Tensor] = None,
                         interleaved: bool = False, fused: bool = False,
                         cu_seqlens: Optional[torch.Tensor] = None, cp_size: int = 1,
                         cp_rank: int = 0) -> torch.Tensor:
    """Rotate ``t`` (``[s, b, h, d]``, ``[b, s, h, d]`` or ``[t, h, d]``) by the angles
    ``freqs`` (``[s2, 1, 1, d2]`` with ``s2`` covering every position and ``d2 <= d``),
    as NOTE [Rotary layouts] describes.

    ``start_positions`` (``[b]``): sequence ``b`` starts at that position (inference
    with a KV cache). ``cu_seqlens`` (``[b + 1]``, for ``thd``): the sequence
    boundaries (``cu_seqlens_padded`` with context parallelism: the global ones,
    each a multiple of ``2 * cp_size``). ``cp_size`` / ``cp_rank``: ``t`` is this
    rank's share of the load-balanced context-parallel split. ``fused`` is accepted
    for TE compatibility; both ways compute the same float32 rotation.
    """
    api = "apply_rotary_pos_emb"
    check_choice(api, "tensor_format", tensor_format, ROPE_FORMATS)
    if not torch.is_tensor(t) or not t.is_floating_point():
        raise TypeError(f"{api}: t must be a floating-point tensor, got "
                        f"{t.dtype if torch.is_tensor(t) else type(t).__name__}")
    if t.dim() != (3 if tensor_format == "thd" else 4):
        raise ValueError(f"{api}: t must be {'[t, h, d]' if tensor_format == 'thd' else '4-D'} "
                         f"for tensor_format={tensor_format!r}, got shape {tuple(t.shape)}")
    if not torch.is_tensor(freqs) or freqs.dim() != 4 or freqs.shape[1:3] != (1, 1) \
            or freqs.shape[-1] > t.shape[-1] or freqs.shape[-1] % 2:
        got = tuple(freqs.shape) if torch.is_tensor(freqs) else type(freqs).__name__
        raise ValueError(f"{api}: freqs must be [s, 1, 1, d2] with an even d2 <= the head size "
                         f"{t.shape[-1]}, got {got}")
    check_positive_int(api, "cp_size", cp_size)
    if isinstance(cp_rank, bool) or not isinstance(cp_rank, int) or not 0 <= cp_rank < cp_size:
        raise ValueError(f"{api}: cp_rank must be an int in [0, cp_size={cp_size}), got {cp_rank!r}")
    if torch.compiler.is_compiling() and (tensor_format == "thd" or start_positions is not None):
        raise NotImplementedError(
            f"torch.compile: {api} with "
            f"{'tensor_format=thd' if tensor_format == 'thd' else 'start_positions'} cannot "
            "be compiled (the positions it rotates by are read from the device); call it "
            "outside the compiled function")
    angles_all = freqs.to(torch.float32)
    if tensor_format == "thd":
        return _apply_thd(api, t, angles_all, start_positions, interleaved, cu_seqlens,
                          cp_size, cp_rank)
    s_dim = 0 if tensor_format == "sbhd" else 1
    seqlen = t.shape[s_dim]
    if cp_size > 1 and seqlen % 2:
        raise ValueError(f"{api}: with cp_size > 1 each rank holds two equal chunks, so the "
                         f"local sequence length must be even, got {seqlen}")
    pos = _cp_positions(seqlen, cp_size, cp_rank, t.device)             # [s]
    if start_positions is not None:
        starts = _check_int_vector(api, "start_positions", start_positions, t.shape[1 - s_dim])
        pos = starts.to(t.device).reshape(-1, 1) + pos.reshape(1, -1)   # [b, s]
    # the last position: known without reading the device where there are no start
    # positions (and so traceable by torch.compile)
    last = (int(pos.max()) if start_positions is not None
            else seqlen - 1 if cp_size == 1 else seqlen * cp_size - cp_rank * (seqlen // 2) - 1)
    if last >= angles_all.shape[0]:
        raise ValueError(f"{api}: freqs covers {angles_all.shape[0]} positions, but position "
                         f"{last} is needed")
    angles = angles_all[:, 0, 0, :].index_select(0, pos.reshape(-1).to(angles_all.device))
    if start_positions is None:                                          # [s, 1, d2]
        angles = angles.reshape(seqlen, 1, -1)
        angles = angles.unsqueeze(1) if tensor_format == "sbhd" else angles
    else:                                                                # [b, s, 1, d2]
        angles = angles.reshape(pos.shape[0], seqlen, 1, -1)
        angles = angles.transpose(0, 1) if tensor_format == "sbhd" else angles
    return _rotate(t, angles.to(t.device), interleaved)


def _apply_thd(api, t, angles_all, start_positions, interleaved, cu_seqlens, cp_size, cp_rank):
    if cu_seqlens is None:
        raise ValueError(f"{api}: tensor_format='thd' needs cu_seqlens (the [b + 1] sequence "
                         "boundaries)")
    bounds = [int(v) for v in _check_int_vector(api, "cu_seqlens", cu_seqlens).tolist()]
    if len(bounds) < 2 or bounds[0] != 0 or any(b < a for a, b in zip(bounds, bounds[1:])) \
            or bounds[-1] > t.shape[0] * cp_size:
        raise ValueError(f"{api}: cu_seqlens must start at 0, never decrease and end within the "
                         f"{t.shape[0]} tokens, got {bounds}")
    local = [b // cp_size for b in bounds]
    starts = None
    if start_positions is not None:
        starts = _check_int_vector(api, "start_positions", start_positions, len(bounds) - 1)
        starts = [int(v) for v in starts.tolist()]
    pieces = []
    for i, (lo, hi) in enumerate(zip(local, local[1:])):
        if cp_size > 1 and (hi - lo) % 2:
            raise ValueError(f"{api}: with cp_size > 1 every local sequence length must be even, "
                             f"sequence {i} has {hi - lo}")
        pos = _cp_positions(hi - lo, cp_size, cp_rank, angles_all.device)
        pieces.append(pos + (starts[i] if starts is not None else 0))
    pos = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)
    if pos.numel() and int(pos.max()) >= angles_all.shape[0]:
        raise ValueError(f"{api}: freqs covers {angles_all.shape[0]} positions, but position "
                         f"{int(pos.max())} is needed")
    n = local[-1]
    angles = angles_all[:, 0, 0, :].index_select(0, pos).reshape(n, 1, -1).to(t.device)
    rotated = _rotate(t[:n], angles, interleaved)
    return rotated if n == t.shape[0] else torch.cat((rotated, t[n:]), dim=0)


def apply_fused_qkv_rotary_pos_emb(qkv: torch.Tensor, q_freqs: torch.Tensor,
                                   k_freqs: torch.Tensor, qkv_split_arg_list,
                                   tensor_format: str = "sbhd",
                                   start_positions: Optional[torch.Tensor] = None,
                                   interleaved: bool = False,
                                   cu_seqlens: Optional[torch.Tensor] = None, cp_size: int = 1,
                                   cp_rank: int = 0):
    """Split ``qkv`` (``[s, b, h, q + k + v]`` or ``[b, s, h, q + k + v]``) into
    queries, keys and values by ``qkv_split_arg_list = [q, k, v]`` and rotate the
    queries by ``q_freqs`` and the keys by ``k_freqs`` (`apply_rotary_pos_emb`).

    As TE's: the query part of each head is ``q / k`` heads of size ``k``, so the
    outputs are ``[.., h * q / k, k]``, ``[.., h, k]`` and ``[.., h, v]`` (values
    copied). ``cu_seqlens`` is accepted and unused (no ``thd``); ``start_positions``
    cannot be combined with ``cp_size > 1``, as in TE.
    """
    api = "apply_fused_qkv_rotary_pos_emb"
    check_choice(api, "tensor_format", tensor_format, ("sbhd", "bshd"))
    if not torch.is_tensor(qkv) or qkv.dim() != 4:
        got = tuple(qkv.shape) if torch.is_tensor(qkv) else type(qkv).__name__
        raise ValueError(f"{api}: qkv must be a 4-D tensor ({tensor_format}), got {got}")
    split = list(qkv_split_arg_list) if isinstance(qkv_split_arg_list, (list, tuple)) else None
    if (split is None or len(split) != 3
            or any(isinstance(n, bool) or not isinstance(n, int) or n <= 0 for n in split)
            or sum(split) != qkv.shape[-1] or split[0] % split[1]):
        raise ValueError(f"{api}: qkv_split_arg_list must be three positive ints [q, k, v] "
                         f"summing to qkv's last dimension {qkv.shape[-1]}, with q a multiple "
                         f"of k, got {qkv_split_arg_list!r}")
    if cp_size != 1 and start_positions is not None:
        raise ValueError(f"{api}: start_positions cannot be combined with cp_size > 1 (TE "
                         "supports it for inference only)")
    q, k, v = qkv.split(split, dim=-1)
    q = q.reshape(*q.shape[:2], q.shape[2] * (split[0] // split[1]), split[1])
    rotate = dict(tensor_format=tensor_format, start_positions=start_positions,
                  interleaved=interleaved, cp_size=cp_size, cp_rank=cp_rank)
    return (apply_rotary_pos_emb(q, q_freqs, **rotate), apply_rotary_pos_emb(k, k_freqs, **rotate),
            v.contiguous() if not v.is_contiguous() else v.clone())
