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


def act_ref(x, activation):
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


def mha_ref(p, x, heads, groups, d, interleaved, mask_type, mask=None, ln=("LayerNorm", 1e-5, False)):
    """MultiheadAttention(input_layernorm=True) on float64 parameters ``p``; returns the
    output and the layernorm output."""
    h_ln = norm_ref(x, p["layernorm_qkv.layer_norm_weight"], p.get("layernorm_qkv.layer_norm_bias"),
                    *ln)
    mixed = h_ln @ p["layernorm_qkv.weight"].t() + p["layernorm_qkv.bias"]
    q, k, v = qkv_split_ref(mixed, heads, groups, d, interleaved)
    ctx = attention_ref(q, k, v, "sbhd", mask_type, mask)
    return ctx @ p["proj.weight"].t() + p["proj.bias"], h_ln


# ---- MLP and transformer layer --------------------------------------------------------------

def mlp_ref(p, x, normalization, activation):
    """LayerNormMLP on float64 parameters ``p``."""
    ln = norm_ref(x, p["layer_norm_weight"], p.get("layer_norm_bias"), normalization, 1e-5, False)
    h = ln @ p["fc1_weight"].t() + p["fc1_bias"]
    return act_ref(h, activation) @ p["fc2_weight"].t() + p["fc2_bias"]


def layer_ref(m, x, post_ln_residual=False, output_layernorm=False, normalization="LayerNorm",
              activation="gelu", groups=4):
    """TransformerLayer(64, 128, 4 heads) in eval mode (no dropout), in float64, from its
    parameters."""
    p = {n: t.detach().double() for n, t in m.named_parameters()}
    sub = lambda prefix: {n[len(prefix):]: t for n, t in p.items() if n.startswith(prefix)}
    attn_p = sub("self_attention.")
    ln = (normalization, 1e-5, False)
    if output_layernorm:           # post-norm: attention on x unnormalized
        mixed = x @ attn_p["qkv.weight"].t() + attn_p["qkv.bias"]
        q, k, v = qkv_split_ref(mixed, 4, groups, 16, True)
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
