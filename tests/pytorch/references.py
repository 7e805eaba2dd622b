"""Float64 references written with plain torch ops, and how tests compare against them.

The references take float64 tensors (parameters as ``{name: tensor}`` dicts, as
``named_parameters()`` spells them) and follow TE's conventions: masks are True where
masked out, the fused QKV weight holds TE's row layout, ``sbhd`` / ``bshd`` layouts.

Error measures: `rel_err` (``max|got - ref| / max|ref|``, for the tight bounds of exact
references) and `norm_rel_err` (relative error in norm, for FP8 against high precision).
"""

import math

import torch

from transformer_engine.pytorch import quantize

# ---- comparing against a reference ------------------------------------------------------------

def rel_err(got, ref):
    ref = ref.double()
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


def norm_rel_err(got, ref):
    ref = ref.double()
    return ((got.double() - ref).norm() / ref.norm()).item()


def assert_close(got, ref, bound, what):
    err = rel_err(got, ref)
    assert err <= bound, f"{what}: error {err:.3g} relative to max |ref| exceeds {bound:.3g}"


def randomize_(module):
    """Non-trivial norm gains and shifts and linear biases (the defaults are 1 and 0)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() != 1:
                continue
            if name.rsplit(".", 1)[-1] in ("weight", "layer_norm_weight"):   # norm gains
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:                                                            # shifts, biases
                p.normal_(0.0, 0.1)


def leaf64(t):
    """A float64 leaf copy of ``t`` that collects its own gradient (None stays None)."""
    return None if t is None else t.detach().double().requires_grad_()


def padding_mask(b, s, lengths):
    """TE's padding mask ``[b, 1, 1, s]``: True past each sequence's length."""
    return torch.stack([torch.arange(s) >= n for n in lengths]).reshape(b, 1, 1, s)


# ---- FP8 operands ----------------------------------------------------------------------------

def deq(t, scale, dtype):
    """The float64 value of ``t`` cast to FP8 with ``scale``."""
    return quantize.cast_to_fp8(t.detach(), scale, dtype).dequantize(torch.float64)


def cast_scale(module, recipe, forward, slot, tensor):
    """The scale ``module`` casts ``tensor`` (its slot ``slot``) with: the delayed scale
    in force, or the tensor's own current scale."""
    fmt = recipe.fp8_format.value
    if recipe.delayed():
        key = "scaling_fwd" if forward else "scaling_bwd"
        return module.fp8_meta[key].scale[slot:slot + 1].clone()
    dtype = fmt.dtype_fwd if forward else fmt.dtype_bwd
    return quantize.current_scale(quantize.amax(tensor.detach()), dtype)


# ---- norms and activations ------------------------------------------------------------------

def norm_ref(x, weight, bias, normalization, eps, zero_centered_gamma):
    gamma = weight + 1.0 if zero_centered_gamma else weight
    if normalization == "LayerNorm":
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)
        return (x - mean) / torch.sqrt(var + eps) * gamma + bias
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * gamma


_ACT_REF = {
    "gelu": lambda x: 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3))),
    "relu": lambda x: torch.where(x > 0, x, torch.zeros_like(x)),
    "qgelu": lambda x: x / (1 + torch.exp(-1.702 * x)),
    "srelu": lambda x: torch.where(x > 0, x * x, torch.zeros_like(x)),
    "silu": lambda x: x / (1 + torch.exp(-x)),
}
GATED_ACTIVATIONS = {"geglu": "gelu", "qgeglu": "qgelu", "reglu": "relu", "sreglu": "srelu",
                     "swiglu": "silu"}
"""Each gated activation and the activation of its gate half."""


def clamped_swiglu_ref(x, limit=7.0, alpha=1.702, glu_linear_offset=1.0):
    """TE's clamped SwiGLU: the first half clamped above at ``limit`` and activated by
    ``a * sigmoid(alpha * a)``, times the second half clamped to ``[-limit, limit]``
    plus ``glu_linear_offset``."""
    half = x.shape[-1] // 2
    a = torch.clamp(x[..., :half], max=limit)
    b = torch.clamp(x[..., half:], -limit, limit) + glu_linear_offset
    return a / (1 + torch.exp(-alpha * a)) * b


def clamped_swiglu_grad_ref(x, dy, limit=7.0, alpha=1.702, glu_linear_offset=1.0):
    """The gradient TE's clamped SwiGLU backward computes, written out: the activated
    half's derivative where ``a <= limit`` (else 0), the linear half's where
    ``|b| <= limit`` (else 0)."""
    half = x.shape[-1] // 2
    a_in, b_in = x[..., :half], x[..., half:]
    a = torch.clamp(a_in, max=limit)
    b = torch.clamp(b_in, -limit, limit) + glu_linear_offset
    s = 1 / (1 + torch.exp(-alpha * a))
    da = torch.where(a_in <= limit, s + alpha * a * s * (1 - s), torch.zeros_like(a)) * dy * b
    db = torch.where(b_in.abs() <= limit, a * s, torch.zeros_like(a)) * dy
    return torch.cat([da, db], dim=-1)


def act_ref(x, activation, params=None):
    if activation == "clamped_swiglu":
        return clamped_swiglu_ref(x, **(params or {}))
    if activation in GATED_ACTIVATIONS:
        half = x.shape[-1] // 2
        return _ACT_REF[GATED_ACTIVATIONS[activation]](x[..., :half]) * x[..., half:]
    return _ACT_REF[activation](x)


# ---- attention ----------------------------------------------------------------------------

def attention_ref(q, k, v, fmt, mask_type, mask=None, scale=None):
    """softmax(q k^T * scale, masked) v with TE's masks (True = masked out)."""
    if fmt == "sbhd":
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    else:
        q, k, v = (t.permute(0, 2, 1, 3) for t in (q, k, v))
    b, h, sq, d = q.shape
    rep = h // k.shape[1]
    k = torch.cat([k[:, i // rep:i // rep + 1] for i in range(h)], dim=1)
    v = torch.cat([v[:, i // rep:i // rep + 1] for i in range(h)], dim=1)
    skv = k.shape[2]
    scores = q @ k.transpose(-1, -2) * (scale if scale is not None else d ** -0.5)
    allowed = torch.ones(b, h, sq, skv, dtype=torch.bool)
    if mask_type in ("causal", "padding_causal"):
        allowed &= torch.tensor([[j <= i for j in range(skv)] for i in range(sq)])
    if mask_type in ("padding", "padding_causal"):
        allowed &= ~mask.reshape(b, 1, 1, skv)
    if mask_type == "arbitrary":
        allowed &= ~mask
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    out = probs @ v
    if mask_type in ("padding", "padding_causal"):
        out = out * (~mask.reshape(b, 1, sq, 1))
    out = out.permute(2, 0, 1, 3) if fmt == "sbhd" else out.permute(0, 2, 1, 3)
    return out.reshape(*out.shape[:2], h * d)


def qkv_split_ref(mixed, h, g, d, interleaved):
    """TE's fused QKV layout, by explicit row indices: interleaved groups hold
    ``[q heads of the group, k, v]``; otherwise all q rows, then k, then v."""
    r = h // g
    if interleaved:
        q_rows = [(i // r * (r + 2) + i % r) for i in range(h)]
        k_rows, v_rows = [j * (r + 2) + r for j in range(g)], [j * (r + 2) + r + 1 for j in range(g)]
    else:
        q_rows, k_rows, v_rows = list(range(h)), [h + j for j in range(g)], [h + g + j for j in range(g)]
    pick = lambda rows: torch.stack([mixed[..., row * d:(row + 1) * d] for row in rows], dim=-2)
    return pick(q_rows), pick(k_rows), pick(v_rows)


def fused_qkv_ref(p, prefix):
    """The QKV weight and bias: the fused ones (layout None: the caller's), or TE's
    default split parameters (``query_weight``, ...) concatenated, which is the
    non-interleaved layout (layout False)."""
    if prefix + "weight" in p:
        return p[prefix + "weight"], p[prefix + "bias"], None
    parts = ("query", "key", "value")
    return (torch.cat([p[f"{prefix}{n}_weight"] for n in parts]),
            torch.cat([p[f"{prefix}{n}_bias"] for n in parts]), False)


def mha_ref(p, x, heads, groups, d, interleaved, mask_type, mask=None, ln=("LayerNorm", 1e-5, False)):
    """MultiheadAttention(input_layernorm=True) on float64 parameters ``p``; returns the
    output and the layernorm output."""
    h_ln = norm_ref(x, p["layernorm_qkv.layer_norm_weight"], p.get("layernorm_qkv.layer_norm_bias"),
                    *ln)
    w_qkv, b_qkv, layout = fused_qkv_ref(p, "layernorm_qkv.")
    interleaved = interleaved if layout is None else layout
    mixed = h_ln @ w_qkv.t() + b_qkv
    q, k, v = qkv_split_ref(mixed, heads, groups, d, interleaved)
    ctx = attention_ref(q, k, v, "sbhd", mask_type, mask)
    return ctx @ p["proj.weight"].t() + p["proj.bias"], h_ln


# ---- MLP and transformer layer --------------------------------------------------------------

def mlp_ref(p, x, normalization, activation, params=None):
    """LayerNormMLP on float64 parameters ``p`` (``params``: the activation's)."""
    ln = norm_ref(x, p["layer_norm_weight"], p.get("layer_norm_bias"), normalization, 1e-5, False)
    h = ln @ p["fc1_weight"].t() + p["fc1_bias"]
    return act_ref(h, activation, params) @ p["fc2_weight"].t() + p["fc2_bias"]


def layer_ref(m, x, post_ln_residual=False, output_layernorm=False, normalization="LayerNorm",
              activation="gelu", groups=4):
    """TransformerLayer(64, 128, 4 heads) in eval mode (no dropout), in float64, from its
    parameters."""
    p = {n: t.detach().double() for n, t in m.named_parameters()}
    sub = lambda prefix: {n[len(prefix):]: t for n, t in p.items() if n.startswith(prefix)}
    attn_p = sub("self_attention.")
    ln = (normalization, 1e-5, False)
    if output_layernorm:           # post-norm: attention on x unnormalized
        w_qkv, b_qkv, layout = fused_qkv_ref(attn_p, "qkv.")
        mixed = x @ w_qkv.t() + b_qkv
        q, k, v = qkv_split_ref(mixed, 4, groups, 16, True if layout is None else layout)
        attn = attention_ref(q, k, v, "sbhd", "causal") @ attn_p["proj.weight"].t() + attn_p["proj.bias"]
        ln1 = None
    else:
        attn, ln1 = mha_ref(attn_p, x, 4, groups, 16, True, "causal", ln=ln)
    hidden = attn + (ln1 if post_ln_residual and not output_layernorm else x)
    mlp_p = sub("layernorm_mlp.")
    ln2 = norm_ref(hidden, mlp_p["layer_norm_weight"], mlp_p.get("layer_norm_bias"), *ln)
    mlp = act_ref(ln2 @ mlp_p["fc1_weight"].t() + mlp_p["fc1_bias"], activation) \
        @ mlp_p["fc2_weight"].t() + mlp_p["fc2_bias"]
    out = mlp + (ln2 if post_ln_residual else hidden)
    if output_layernorm:
        out = norm_ref(out, p["layernorm.weight"], p.get("layernorm.bias"), *ln)
    return out


# ---- attention masks from TE's definitions, rotary embeddings as complex numbers ----------------

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
