"""Helpers shared across the package: the argument checks of the public modules
(each raises with the calling API's name and the value it got), nested-structure
flattening for checkpointed and graphed callables' outputs, and the helpers TE's
``transformer_engine.pytorch.utils`` offers its users (initializers, the attention
mask function, device queries)."""

from __future__ import annotations

import math
from typing import Any, Callable, Tuple, Union

import torch

__all__ = ["flatten_nested", "rebuild_nested", "NORMALIZATIONS", "PARAM_DTYPES",
           "check_positive_int", "check_normalization", "check_eps", "check_input",
           "check_params_dtype", "check_input_dtype", "check_choice", "check_dropout",
           "check_hidden_states_dtype", "check_process_group", "check_bool",
           "check_optional_positive_int",
           "reject_unsupported", "UNSUPPORTED_DOC", "init_method_normal",
           "scaled_init_method_normal", "attention_mask_func", "get_device_compute_capability",
           "is_bf16_compatible", "is_bf16_available", "is_non_tn_fp8_gemm_supported"]

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
UNSUPPORTED_DOC = "README section 'Unsupported arguments'"


# ---- argument checks ---------------------------------------------------------------------

def check_positive_int(api: str, name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{api}: {name} must be a positive int, got {value!r}")
    return value


def check_normalization(api: str, normalization) -> str:
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"{api}: normalization must be one of {NORMALIZATIONS}, "
                         f"got {normalization!r}")
    return normalization


def check_eps(api: str, eps, name: str = "eps") -> float:
    """A finite, positive epsilon (inf would normalize everything to 0, NaN to NaN)."""
    if (isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps)
            or not eps > 0):
        raise ValueError(f"{api}: {name} must be a finite positive float, got {eps!r}")
    return float(eps)


def check_input(api: str, inp, features: int, name: str = "hidden_size") -> None:
    """A floating-point tensor whose last dimension is ``features``."""
    if not torch.is_tensor(inp):
        raise TypeError(f"{api}: input must be a tensor, got {type(inp).__name__}")
    if not inp.is_floating_point():
        raise TypeError(f"{api}: input must be a floating-point tensor, got dtype {inp.dtype}")
    if inp.dim() == 0 or inp.shape[-1] != features:
        raise ValueError(f"{api}: the input's last dimension must be {name}={features}, "
                         f"got input of shape {tuple(inp.shape)}")


def check_params_dtype(api: str, params_dtype) -> torch.dtype:
    dtype = params_dtype if params_dtype is not None else torch.get_default_dtype()
    if dtype not in PARAM_DTYPES:
        raise TypeError(f"{api}: params_dtype must be torch.float32, torch.bfloat16 or "
                        f"torch.float16, got {dtype}")
    return dtype


def check_input_dtype(api: str, x: torch.Tensor, weight: torch.Tensor, fp8: bool) -> None:
    """Outside FP8 and ``torch.autocast`` a GEMM takes the input in the parameters'
    dtype (TE refuses other inputs there too); say so instead of torch's matmul error.
    In FP8 both operands are cast anyway, and ``torch.autocast`` casts them itself."""
    if x.dtype != weight.dtype and not fp8 and not torch.is_autocast_enabled(x.device.type):
        raise TypeError(f"{api}: outside te.autocast (FP8) and torch.autocast the input must "
                        f"have the parameters' dtype {weight.dtype}, got {x.dtype}; cast the "
                        f"input, build the module with params_dtype={x.dtype}, or run it "
                        "under torch.autocast")


def check_bool(api: str, name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{api}: {name} must be a bool, got {value!r}")
    return value


def check_optional_positive_int(api: str, name: str, value):
    """None, or a positive int."""
    return None if value is None else check_positive_int(api, name, value)


def reject_unsupported(api: str, **settings) -> None:
    """Refuse the TE keyword arguments whose feature this package does not implement.

    ``settings`` maps each argument's name to ``(value, default)``; a value other than
    its default raises ``NotImplementedError`` naming the argument, so a TE script that
    relies on the feature stops instead of silently running without it.
    """
    for name, (value, default) in settings.items():
        if value is default or (type(value) is type(default) and value == default):
            continue
        raise NotImplementedError(
            f"{api}: {name}={value!r} is not implemented by this pure-PyTorch Transformer "
            f"Engine; leave it at its default ({default!r}). See the {UNSUPPORTED_DOC}.")


def check_choice(api: str, name: str, value, choices) -> str:
    if value not in choices:
        raise ValueError(f"{api}: {name} must be one of {choices}, got {value!r}")
    return value


def check_dropout(api: str, name: str, p, allow_one: bool = False) -> float:
    """A probability in [0, 1) (or [0, 1] with ``allow_one``)."""
    if (isinstance(p, bool) or not isinstance(p, (int, float))
            or not (0.0 <= p <= 1.0 if allow_one else 0.0 <= p < 1.0)):
        raise ValueError(f"{api}: {name} must be a float in [0, {1 if allow_one else '1)'}"
                         f"{']' if allow_one else ''}, got {p!r}")
    return float(p)


def check_hidden_states_dtype(api: str, hidden_states: torch.Tensor, weight: torch.Tensor,
                              fp8: bool) -> None:
    """A floating-point input that the first GEMM can take (`check_input_dtype`),
    checked where the user called, so the error names that API."""
    if not hidden_states.is_floating_point():
        raise TypeError(f"{api}: hidden_states must be a floating-point tensor, got dtype "
                        f"{hidden_states.dtype}")
    check_input_dtype(api, hidden_states, weight, fp8)


def check_process_group(api: str, name: str, group) -> None:
    """None, or a ``ProcessGroup`` of an initialized ``torch.distributed``."""
    if group is None:
        return
    dist = torch.distributed
    if not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
        raise TypeError(f"{api}: {name} must be a torch.distributed.ProcessGroup or None, "
                        f"got {type(group).__name__}")
    if not dist.is_initialized():
        raise ValueError(f"{api}: {name} was given but torch.distributed is not "
                         "initialized; call torch.distributed.init_process_group() first")


# ---- nested structures ---------------------------------------------------------------------


def flatten_nested(obj) -> Tuple[list, Any]:
    """The leaves of nested tuples, lists and dicts (named tuples are leaves), and a
    spec that `rebuild_nested` turns back into the same structure."""
    if isinstance(obj, (tuple, list)) and not hasattr(obj, "_fields"):
        leaves, specs = [], []
        for item in obj:
            sub, spec = flatten_nested(item)
            leaves += sub
            specs.append((len(sub), spec))
        return leaves, (type(obj), specs)
    if isinstance(obj, dict):
        keys = list(obj)
        leaves, spec = flatten_nested([obj[k] for k in keys])
        return leaves, (dict, keys, spec)
    return [obj], None


def rebuild_nested(leaves: list, spec):
    """The structure `flatten_nested` described, with ``leaves`` in place."""
    if spec is None:
        return leaves[0]
    if spec[0] is dict:
        _, keys, inner = spec
        return dict(zip(keys, rebuild_nested(leaves, inner)))
    kind, specs = spec
    items, start = [], 0
    for count, sub in specs:
        items.append(rebuild_nested(leaves[start:start + count], sub))
        start += count
    return kind(items)


# ---- TE's public helpers -------------------------------------------------------------------

def init_method_normal(sigma: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """An initializer drawing from N(0, sigma)."""
    def init_(tensor: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.normal_(tensor, mean=0.0, std=sigma)
    return init_


def scaled_init_method_normal(sigma: float, num_layers: int) -> Callable[[torch.Tensor],
                                                                           torch.Tensor]:
    """An initializer drawing from N(0, sigma / sqrt(2 num_layers)) (output layers)."""
    return init_method_normal(sigma / math.sqrt(2.0 * num_layers))


def attention_mask_func(attention_scores: torch.Tensor,
                        attention_mask: torch.Tensor) -> torch.Tensor:
    """Fill the masked (True) scores with -10000, in place, and return them."""
    return attention_scores.masked_fill_(attention_mask, -10000.0)


def get_device_compute_capability() -> Tuple[int, int]:
    """The current CUDA device's compute capability; ``(0, 0)`` without CUDA (this
    package also runs on the CPU, where TE would fail)."""
    if not torch.cuda.is_available():
        return (0, 0)
    return tuple(torch.cuda.get_device_capability(torch.cuda.current_device()))


def is_bf16_compatible() -> bool:
    """bfloat16 compute: on CUDA from compute capability 8.0; always on the CPU."""
    return not torch.cuda.is_available() or get_device_compute_capability()[0] >= 8


def is_bf16_available(return_reason: bool = False) -> Union[bool, Tuple[bool, str]]:
    """`is_bf16_compatible`; with ``return_reason``, ``(available, reason)``."""
    ok = is_bf16_compatible()
    if not return_reason:
        return ok
    return ok, "" if ok else "bfloat16 needs compute capability 8.0 or newer"


def is_non_tn_fp8_gemm_supported() -> bool:
    """Whether FP8 GEMMs take operands in other layouts than TN (Blackwell, as TE
    decides it); False on Hopper and without CUDA."""
    cc = get_device_compute_capability()
    return (10, 0) <= cc < (12, 0) or cc >= (13, 0)
