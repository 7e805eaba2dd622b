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
    "test_fusible_ops.py": 4,
    "test_fused_optimizer.py": 1,
    "test_multi_tensor.py": 2,
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
                          "(NVTE_TEST_CHECKPOINT_ARTIFACT_PATH)",
    "test_hf_integration.py": "needs the transformers package",
    "test_sanity_import.py": "has no test (prints OK on import)",
    "test_float8_current_scaling_exact.py": "tex kernels and custom_recipes reference quantizers",
    "test_float8_blockwise_gemm_exact.py": "tex block-scaled GEMM kernels",
    "test_float8_blockwise_scaling_exact.py": "tex block-scaled cast kernels",
    "test_float8blockwisetensor.py": "Float8BlockQuantizer / Float8BlockwiseQTensor",
    "test_quantized_tensor.py": "TE's quantizer classes (Float8Quantizer, MXFP8, NVFP4)",
    "test_cpu_offloading.py": "get_cpu_offload_context (not implemented)",
    "test_cpu_offloading_v1.py": "get_cpu_offload_context (not implemented)",
    "other files": "grouped tensors / permutation / router / ONNX / custom recipes / "
                   "MXFP8 and NVFP4 kernel-exactness files (test_mxfp8_2d_quantize.py, mxfp8/, "
                   "nvfp4/): NVIDIA-native kernels or not part of this package; not reviewed "
                   "again since te.ops, te.optimizers and the MXFP8 / NVFP4 recipes came",
}

# The parameter ids of TE's quantization schemes (test_fusible_ops.py's
# ``quantization`` parameter): "fp8_delayed_scaling", "mxfp8", "nvfp4_4over6", ...
_QUANTIZED_IDS = r"(^|-)(fp8\w*|mxfp8|nvfp4\w*)(-|$)"

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
    # test_recipe.py
    ("test_recipe.py::TestFP8Recipe::test_scale_update_numeric_scenarios", None,
     "calls tex.fused_amax_and_scale_update_after_reduction (NVIDIA-native kernel)"),
    ("test_recipe.py::TestFP8Recipe::test_dynamic_recipe_update", None,
     "asserts the classes of TE's per-module quantizer objects (module.quantizers, MXFP8 / "
     "Float8Block quantizers); the recipe-change warning it also checks is tested in "
     "tests/pytorch/test_fp8_autocast.py"),
    ("test_recipe.py::test_nvfp4_row_scaled_quantizer_roles", None,
     "quantization.NVFP4BlockScalingRecipeState and QuantizerRole: TE's recipe-state "
     "internals (TE >= 2.12), not this package's API"),
    ("test_recipe.py::test_fp4_dequantize", None,
     "te.NVFP4Quantizer with TE's constructor (with_rht, stochastic_rounding, ...): the "
     "package's NVFP4Quantizer is tensor.NVFP4Quantizer, not TE's top-level class"),
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
     "(NVIDIA-native)"),
    ("test_backward_override.py::test_grouped_linear_backward_override_matches_reference", None,
     "its reference is computed with cpp_extensions.general_gemm (NVIDIA-native)"),
    ("test_backward_override.py::test_fused_linear_paths_match_backward_override_reference",
     None, "its reference is computed with cpp_extensions.general_gemm (NVIDIA-native)"),
    ("test_backward_override.py::test_fused_bias_activation_matches_masked_linear_backward",
     None, "its reference is computed with cpp_extensions.general_gemm (NVIDIA-native)"),
    ("test_backward_override.py::"
     "test_operation_fuser_rebuilds_userbuffers_fusion_on_backward_override_switch", None,
     "Userbuffers (initialize_ub): communication overlap, not part of this package"),
    ("test_backward_override.py::test_backward_override_memory_peak_report", None,
     "a diagnostic memory report: it prints, and asserts nothing about the API"),
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
    # test_fused_optimizer.py
    ("test_fused_optimizer.py::TestAdamTest::test_grad_scaler", None,
     "utils.gpu_autocast_ctx: TE's internal autocast helper"),
    ("test_fused_optimizer.py::TestAdamTest::test_grad_scaler_capturable", None,
     "utils.gpu_autocast_ctx: TE's internal autocast helper"),
    ("test_fused_optimizer.py::TestAdamTest::test_grad_scaler_capturable_master", None,
     "utils.gpu_autocast_ctx: TE's internal autocast helper"),
    # test_multi_tensor.py (tex.multi_tensor_scale / _l2norm / ... are the package's
    # te.optimizers functions, as in TE: te_standins.STANDIN_ALIASES)
    ("test_multi_tensor.py::test_multi_tensor_compute_scale_and_scale_inv", None,
     "tex.multi_tensor_compute_scale_and_scale_inv: NVIDIA-native kernel, no public TE path"),
    ("test_multi_tensor.py::test_multi_tensor_compute_scale_inv_e8m0", None,
     "tex.multi_tensor_compute_scale_inv_e8m0: NVIDIA-native kernel, no public TE path"),
    # test_fusible_ops.py: te.ops operations this package's te.ops does not build
    ("test_fusible_ops.py::TestBasicOps::test_dropout", None,
     "te.ops.Dropout: an operation this package's te.ops does not build"),
    ("test_fusible_ops.py::TestBasicOps::test_grouped_linear_caller_buffers", None,
     "caller-provided output / grad-input buffers (Sequential's op_kwargs with "
     "OUTPUT_BUFFER_KEY / GRAD_INPUT_BUFFER_KEY): not implemented, te.ops.GroupedLinear "
     "refuses them"),
    ("test_fusible_ops.py::TestBasicOps::test_situglu_mxfp8_quantization", None,
     "its tolerances come from utils.quantization_tols, which reads tex.DType "
     "(NVIDIA-native; a ValueError without it)"),
    ("test_fusible_ops.py::TestSequentialModules::test_grouped_mlp_nvfp4_rht_srelu", None,
     "TE's NVFP4Quantizer(with_rht=True) (NVIDIA-native)"),
    ("test_fusible_ops.py::TestFuser::test_fp8_scale_update", None,
     "its tolerances come from utils.quantization_tols, which reads tex.DType "
     "(NVIDIA-native; a ValueError without it)"),
    # test_fusible_ops.py: QuantizerRole(...) is built on every case
    *[(f"test_fusible_ops.py::{name}", None,
       "builds quantization.QuantizerRole (TE >= 2.12's quantizer-role API, not in this "
       "package) for every case")
      for name in ("TestFuser::test_dtype_cast", "TestBasicOps::test_linear",
                   "TestBasicOps::test_grouped_linear", "TestSequentialModules::test_grouped_mlp",
                   "TestFusedOps::test_forward_linear_bias_activation",
                   "TestFusedOps::test_forward_linear_bias_add",
                   "TestFusedOps::test_forward_linear_scale_add",
                   "TestFusedOps::test_backward_linear_add",
                   "TestFusedOps::test_backward_linear_scale",
                   "TestSequentialModules::test_layernorm_mlp")],
    # test_fusible_ops.py: the quantized cases quantize their inputs with TE's quantizer
    # classes (Float8Quantizer(fp8_dtype=tex.DType...), MXFP8Quantizer, NVFP4Quantizer,
    # Float8BlockQuantizer) and take tolerances from utils.quantization_tols (tex.DType)
    *[(f"test_fusible_ops.py::{name}", _QUANTIZED_IDS,
       "quantized case: TE's quantizer classes with tex.DType (make_reference_and_test_"
       "tensors) and utils.quantization_tols: NVIDIA-native")
      for name in ("TestFuser::test_pyt_autocast", "TestBasicOps::test_identity",
                   "TestBasicOps::test_reshape", "TestBasicOps::test_bias",
                   "TestBasicOps::test_quantize", "TestBasicOps::test_basic_linear",
                   "TestBasicOps::test_basic_linear_quantized",
                   "TestBasicOps::test_layer_norm", "TestBasicOps::test_rmsnorm",
                   "TestBasicOps::test_add_extra_input", "TestBasicOps::test_make_extra_output",
                   "TestBasicOps::test_activation", "TestBasicOps::test_swiglu",
                   "TestBasicOps::test_clamped_swiglu",
                   "TestFusedOps::test_backward_activation_bias",
                   "TestCheckpointing::test_linear",
                   "TestTrainingLoops::test_linear_training_loop",
                   "TestTrainingLoops::test_linear_inference_loop")],
]

# Tests scan.py flags that stay selected: the stand-in is on a path they never take.
REVIEWED_KEPT = {
    "test_sanity.py::test_sanity_grouped_linear":
        "module.is_module_grouped_tensor_path_supported is called only with "
        "NVTE_GROUPED_LINEAR_SINGLE_PARAM=1, which the runner does not set (those cases skip)",
    **{f"test_fusible_ops.py::{name}":
       "make_reference_and_test_tensors reaches TE's quantizer classes only with a "
       "quantization scheme, and this test passes none"
       for name in ("TestBasicOps::test_layer_norm_autocast", "TestBasicOps::test_l2normalization",
                    "TestBasicOps::test_constant_scale", "TestFusedOps::test_backward_add_rmsnorm",
                    "TestBasicOps::test_situglu", "TestBasicOps::test_scaled_swiglu",
                    "TestBasicOps::test_scaled_situglu", "TestBasicOps::test_scaled_srelu",
                    "TestBasicOps::test_scaled_clamped_qgeglu",
                    "TestCustomOps::test_custom_basic_op",
                    "TestCustomOps::test_custom_forward_fused_op1",
                    "TestCustomOps::test_custom_forward_fused_op2",
                    "TestCustomOps::test_custom_backward_fused_op",
                    "TestCustomOps::test_custom_forward_backward_fused_op")},
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
