"""Float64 references for the module-surface tests (test_module_api.py,
test_rotary.py, test_attention_masks.py), written from the definitions with plain
torch ops and explicit loops, independent of the package's code."""

import math

import torch


def rel_err(got, ref):
    ref = ref.double()
    scale = ref.abs().max().clamp_min(1e-30)
    return ((got.double() - ref).abs().max() / scale).item()


def assert_close(got, ref, bound, what):
    err = rel_err(got, ref)
    assert err <= bound, f"{what}: error {err:.3g} relative to max |ref| exceeds {bound:.3g}"


def leaf64(t):
    return None if t is None else t.detach().double().requires_grad_()


# ---- masks: which key j a query i may see, from TE's definitions ------------------------

def allowed_ref(mask_type, window, sq, skv, q_len=None, kv_len=None, arbitrary=None):
    """``[sq, skv]`` bool for one sequence whose valid tokens are the first ``q_len`` /
    ``kv_len`` (padding types), by explicit loops over (i, j)."""
    q_len = sq if q_len is None else q_len
    kv_len = skv if kv_len is None else kv_len
    padding = mask_type.startswith("padding")
    bottom_right = mask_type.endswith("bottom_right")
    causal = "causal" in mask_type
    delta = kv_len - q_len                       # the bottom-right diagonal's offset
    out = torch.zeros(sq, skv, dtype=torch.bool)
    for i in range(sq):
        for j in range(skv):
            ok = True
            if padding and (j >= kv_len):
                ok = False
            if causal and j > i + (delta if bottom_right else 0):
                ok = False
            if window is not None:
                off = 0 if (causal and not bottom_right) else delta
                left, right = window
                if left >= 0 and j < i + off - left:
                    ok = False
                if right >= 0 and j > i + off + right:
                    ok = False
            if arbitrary is not None and bool(arbitrary[i, j]):
                ok = False
            out[i, j] = ok
    return out


def attend_ref(q, k, v, allowed, scale, bias=None, q_valid=None):
    """One sequence: ``q [sq, h, d]``, ``k, v [skv, g, d]`` (GQA: query head i uses
    key/value head ``i // (h / g)``), ``allowed [h or 1, sq, skv]``. A query with no
    allowed key, or an invalid (padded) query, outputs zeros. Returns ``[sq, h * dv]``."""
    sq, h, _ = q.shape
    g = k.shape[1]
    rows = []
    for head in range(h):
        kh, vh = k[:, head // (h // g)], v[:, head // (h // g)]
        scores = q[:, head] @ kh.t() * scale
        if bias is not None:
            scores = scores + bias[head]
        a = allowed[head if allowed.shape[0] > 1 else 0]
        empty = ~a.any(-1, keepdim=True)
        scores = torch.where(empty, torch.zeros_like(scores), scores.masked_fill(~a, float("-inf")))
        probs = torch.where(empty, torch.zeros_like(scores), torch.softmax(scores, dim=-1))
        out = probs @ vh
        if q_valid is not None:
            out = out * q_valid.reshape(sq, 1).to(out.dtype)
        rows.append(out)
    return torch.stack(rows, dim=1).reshape(sq, -1)


# ---- rotary embedding: pairs as complex numbers ----------------------------------------

def rope_angles_ref(dim, positions, base=10000.0):
    """``[len(positions), dim / 2]`` float64 angles ``p * base ** (-2i / dim)``."""
    i = torch.arange(dim // 2, dtype=torch.float64)
    inv = base ** (-2.0 * i / dim)
    return torch.as_tensor(positions, dtype=torch.float64).reshape(-1, 1) * inv


def rotate_ref(x, angles, interleaved):
    """Rotate the first ``2 * angles.shape[-1]`` channels of ``x [..., d]``: each pair
    is a complex number multiplied by ``exp(i angle)``. ``angles`` broadcasts to
    ``x[..., :d2/2]``. Pairs are ``(2i, 2i+1)`` interleaved, else ``(i, i + d2/2)``."""
    half = angles.shape[-1]
    d2 = 2 * half
    body = x[..., :d2]
    if interleaved:
        re, im = body[..., 0::2], body[..., 1::2]
    else:
        re, im = body[..., :half], body[..., half:]
    z = torch.complex(re, im) * torch.polar(torch.ones_like(angles), angles)
    if interleaved:
        rotated = torch.stack((z.real, z.imag), dim=-1).flatten(-2)
    else:
        rotated = torch.cat((z.real, z.imag), dim=-1)
    return torch.cat((rotated, x[..., d2:]), dim=-1)


# ---- blocks ------------------------------------------------------------------------------

def layer_norm_ref(x, w, b, eps):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * w + b


def gelu_tanh_ref(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
