# The test files of the curated PyTorch jobs, sourced by qa/L0_pytorch_unittest/test.sh
# (CPU, CI) and qa/L1_pytorch_gpu/test.sh (the same files with their CUDA cases).
# shellcheck disable=SC2034
TESTS=(
    tests/pytorch/test_recipe.py
    tests/pytorch/test_bad_input.py
    tests/pytorch/test_extra_state.py
    tests/pytorch/test_quantize.py
    tests/pytorch/test_fp8_autocast.py
    tests/pytorch/test_linear.py
    tests/pytorch/test_fp8_activation_recompute.py
    tests/pytorch/test_checkpoint_robustness.py
    tests/pytorch/test_checkpoint_replay.py
    tests/pytorch/test_checkpoint_saved_tensors.py
    tests/pytorch/test_checkpoint_callables.py
    tests/pytorch/test_checkpoint_api.py
    tests/pytorch/test_threads.py
    tests/pytorch/test_backward_update.py
    tests/pytorch/test_non_finite_amax.py
    tests/pytorch/test_recompute_edges.py
    tests/pytorch/test_module_copies.py
    tests/pytorch/test_graph.py
    tests/pytorch/test_modules.py
    tests/pytorch/test_transformer_layer.py
    tests/pytorch/test_triton_kernels.py
    tests/pytorch/test_train_gpt.py
    tests/pytorch/test_package_identity.py
    tests/pytorch/test_accelerate.py
    tests/pytorch/distributed/test_amax_reduction.py
    tests/pytorch/distributed/test_tensor_parallel.py
    tests/pytorch/distributed/test_tensor_parallel_modules.py
    tests/pytorch/distributed/test_distributed_checkpoint.py
)
