"""What the yardstick runs of NVIDIA's ``tests/pytorch``: the files, how many processes
each is split into, and the tests deselected, each with its reason (README.md says
how this list was made and how the counts were produced).

A deselection names a test function (``file::function`` or ``file::Class::method``),
optionally narrowed to the parameter ids matching a regular expression. Everything
else in a selected file runs, and its failures count.
"""

from __future__ import annotations

import os
import re
from typing import Optional

# file -> number of chunks (processes) it runs as; the larger files first
FILES = {
    "test_sanity.py": 16,
    "test_fused_rope.py": 8,
    "test_numerics.py": 8,
    "test_cuda_graphs.py": 6,
    "test_backward_override.py": 1,
    "test_recipe.py": 1,
    "test_qk_norm.py": 1,
    "test_deferred_init.py": 1,
    "test_gqa.py": 1,
    "test_jit.py": 1,
}

# GPU memory (GiB) one chunk process of a file may take at its peak; the runner starts
# a chunk only while the chunks running and it fit in the card's free memory (run.py,
# YARDSTICK_MEMORY_GB), so that no test fails for another process's memory. TE's
# rotary tests hold tensors of up to 3.2 GB (4096 x 2 x 64 x 1536 float32) with their
# gradients and copies (three of its chunks beside other files' ran out of an H100's
# 80 GB); the CUDA-graph tests capture whole models with their static buffers and
# graph pools (twelve processes on one card: 192 of 212 out of memory, five: 3
# failures, none of memory). The values are upper estimates; each chunk logs its
# measured peak (torch's max_memory_reserved), and results.json's ``memory`` gives
# the largest per file, to check them against.
MEMORY_GB = {
    "test_fused_rope.py": 24.0,
    "test_cuda_graphs.py": 14.0,
    "test_numerics.py": 6.0,
    "test_gqa.py": 6.0,
}
DEFAULT_MEMORY_GB = 4.0

# Files of TE's tests/pytorch left out, and why.
EXCLUDED_FILES = {
    "test_grouped_linear.py": "builds NVFP4BlockScaling recipes with TE >= 2.14 fields at import "
                              "time, and most of it tests grouped-GEMM kernels "
                              "(cpp_extensions.general_grouped_gemm)",
    "test_torch_compile.py": "registers torch.library ops on TE's quantizer internals at import "
                             "time (ops.basic.BasicLinear, dynamo.TensorSpec, NVFP4 tensors)",
    "test_checkpoint.py": "loads checkpoint artifacts made by NVIDIA's build "
                          "(NVTE_TEST_CHECKPOINT_ARTIFACT_PATH), and te.ops.Linear",
    "test_hf_integration.py": "needs the transformers package",
    "test_sanity_import.py": "has no test (prints OK on import)",
    "test_fusible_ops.py": "te.ops (fusible operations): not implemented by this package",
    "test_float8_current_scaling_exact.py": "tex kernels and custom_recipes reference quantizers",
    "test_float8_blockwise_gemm_exact.py": "tex block-scaled GEMM kernels",
    "test_float8_blockwise_scaling_exact.py": "tex block-scaled cast kernels",
    "test_float8blockwisetensor.py": "Float8BlockQuantizer / Float8BlockwiseQTensor",
    "test_quantized_tensor.py": "TE's quantizer classes (Float8Quantizer, MXFP8, NVFP4)",
    "test_cpu_offloading.py": "get_cpu_offload_context (not implemented)",
    "test_cpu_offloading_v1.py": "get_cpu_offload_context (not implemented)",
    "other files": "MXFP8 / NVFP4 / grouped tensors / permutation / router / optimizers / "
                   "ONNX / multi-tensor kernels / custom recipes: NVIDIA-native or not part "
                   "of this package",
}

# (test, parameter-id regex or None, reason)
DESELECT = [
    # test_numerics.py
    ("test_numerics.py::test_fp8gemm_with_unfused_quantization", None,
     "calls cpp_extensions.general_gemm with TE's quantizer objects (NVIDIA-native)"),
    # test_sanity.py
    ("test_sanity.py::test_sanity_gemm_with_unalignment", None,
     "calls cpp_extensions.general_gemm (NVIDIA-native)"),
    ("test_sanity.py::test_sanity_fp8_gemm_with_unalignment", None,
     "calls cpp_extensions.general_gemm with a Float8Quantizer (NVIDIA-native)"),
    ("test_sanity.py::test_replace_raw_data_for_float8tensor", None,
     "tensor.utils.replace_raw_data on a Float8CurrentScalingQuantizer tensor (NVIDIA-native)"),
    ("test_sanity.py::test_inference_mode", r"ops\.Linear",
     "te.ops.Linear: fusible operations are not implemented by this package"),
    # test_recipe.py
    ("test_recipe.py::TestFP8Recipe::test_fp8_scale_update_with_linear_fuser_op", None,
     "te.ops.BasicLinear: fusible operations are not implemented by this package"),
    ("test_recipe.py::TestFP8Recipe::test_scale_update_numeric_scenarios", None,
     "calls tex.fused_amax_and_scale_update_after_reduction (NVIDIA-native kernel)"),
    ("test_recipe.py::TestFP8Recipe::test_dynamic_recipe_update", None,
     "asserts the classes of TE's per-module quantizer objects (module.quantizers, MXFP8 / "
     "Float8Block quantizers); the recipe-change warning it also checks is tested in "
     "tests/pytorch/test_fp8_autocast.py"),
    ("test_recipe.py::test_nvfp4_row_scaled_quantizer_roles", None,
     "NVFP4 recipe state and quantizer roles (NVFP4 is not implemented)"),
    ("test_recipe.py::test_fp4_dequantize", None,
     "NVFP4Quantizer (NVFP4 is not implemented)"),
    ("test_recipe.py::test_checkpoint_extra_state_policy_classifier_map_covers_all_recipes", None,
     "TE >= 2.14's private _extra_state policy table"),
    ("test_recipe.py::test_stateless_pickled_extra_state_is_ignored", None,
     "TE >= 2.14's private _extra_state.should_load_extra_state_pickle"),
    ("test_recipe.py::test_stateless_custom_pickled_extra_state_is_ignored", None,
     "TE >= 2.14's private _extra_state module and CustomRecipe (not implemented)"),
    ("test_recipe.py::test_global_free_pickled_extra_state_is_ignored", None,
     "TE >= 2.14's private _extra_state.should_load_extra_state_pickle"),
    ("test_recipe.py::test_stateful_unknown_or_malformed_pickled_extra_state_requires_opt_in",
     None, "TE >= 2.14's private _extra_state module and CustomRecipe (not implemented)"),
    # test_cuda_graphs.py
    ("test_cuda_graphs.py::test_make_graphed_callables", r"linear_op",
     "te.ops.Sequential / te.ops.Linear: fusible operations are not implemented"),
    ("test_cuda_graphs.py::test_make_graphed_callables_with_fp8_weight_caching", r"linear_op",
     "te.ops.Sequential / te.ops.Linear: fusible operations are not implemented"),
    # test_jit.py
    ("test_jit.py::test_lazy_compile", None,
     "transformer_engine.pytorch.jit: TE's internal fused elementwise functions"),
    ("test_jit.py::test_l2normalization_fused", None,
     "transformer_engine.pytorch.jit: TE's internal fused elementwise functions"),
    ("test_jit.py::test_l2normalization_fused_correctness", None,
     "transformer_engine.pytorch.jit: TE's internal fused elementwise functions"),
    # test_backward_override.py
    ("test_backward_override.py::test_linear_like_backward_override_matches_reference", None,
     "its reference is computed with cpp_extensions.general_gemm / layernorm_bwd "
     "(NVIDIA-native), and some cases use te.ops.Linear"),
    ("test_backward_override.py::test_grouped_linear_backward_override_matches_reference", None,
     "its reference is computed with cpp_extensions.general_gemm (NVIDIA-native)"),
    ("test_backward_override.py::test_fused_linear_paths_match_backward_override_reference",
     None, "te.ops fused operations and cpp_extensions.general_gemm"),
    ("test_backward_override.py::test_fused_bias_activation_matches_masked_linear_backward",
     None, "te.ops fused operations and cpp_extensions.general_gemm"),
    ("test_backward_override.py::"
     "test_operation_fuser_rebuilds_userbuffers_fusion_on_backward_override_switch", None,
     "te.ops operation fuser and Userbuffers"),
    ("test_backward_override.py::test_quantize_op_respects_backward_override", None,
     "te.ops.Quantize"),
    ("test_backward_override.py::test_backward_override_memory_peak_report", None,
     "builds te.ops.Linear modules for some cases; a diagnostic report, no assertion on API"),
    ("test_backward_override.py::"
     "test_linear_backward_override_dequantized_ignores_save_original_input", None,
     "reads TE's saved operands through quantized_tensor.restore_from_saved(grad_fn."
     "tensor_objects): internals of NVIDIA's autograd functions"),
    ("test_backward_override.py::"
     "test_grouped_linear_backward_override_dequantized_ignores_save_original_input", None,
     "reads TE's saved operands through quantized_tensor.restore_from_saved: internals"),
    ("test_backward_override.py::"
     "test_linear_backward_override_high_precision_forces_save_original_input", None,
     "reads TE's saved operands through quantized_tensor.restore_from_saved: internals"),
    ("test_backward_override.py::"
     "test_grouped_linear_backward_override_high_precision_forces_save_original_input", None,
     "reads TE's saved operands through quantized_tensor.restore_from_saved: internals"),
    ("test_backward_override.py::test_linear_like_runtime_backward_override_switch_updates_ctx",
     None, "asserts attributes of NVIDIA's autograd ctx (grad_fn.backward_override, "
     "grad_output_quantizer, reduce_and_update_bwd_fp8_tensors): internals, not API"),
    ("test_backward_override.py::test_grouped_linear_runtime_backward_override_switch_updates_ctx",
     None, "asserts attributes of NVIDIA's autograd ctx: internals, not API"),
]

# Tests scan.py flags that stay selected: the stand-in is on a path they never take.
REVIEWED_KEPT = {
    "test_sanity.py::test_sanity_grouped_linear":
        "module.is_module_grouped_tensor_path_supported is called only with "
        "NVTE_GROUPED_LINEAR_SINGLE_PARAM=1, which the runner does not set (those cases skip)",
    "test_cuda_graphs.py::test_make_graphed_callables_grouped_linear_with_fp8_weight_caching":
        "the te.ops branch of the shared helper is for module='linear_op' only",
}

_BY_TEST = {}
for _test, _ids, _reason in DESELECT:
    _BY_TEST.setdefault(_test, []).append((re.compile(_ids) if _ids else None, _reason))


def test_key(nodeid: str) -> str:
    """``file.py::function`` (or ``file.py::Class::method``) of a node id, whatever
    folder the id is relative to."""
    path, _, rest = nodeid.partition("::")
    return f"{os.path.basename(path)}::{rest.split('[', 1)[0]}"


def deselection_reason(nodeid: str) -> Optional[str]:
    """Why this test is deselected, or None when it runs."""
    params = nodeid.partition("[")[2].rstrip("]")
    for ids, reason in _BY_TEST.get(test_key(nodeid), ()):
        if ids is None or ids.search(params):
            return reason
    return None
