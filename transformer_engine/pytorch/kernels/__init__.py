"""Triton kernels, one file per family: `casts` (the FP8 casts, amaxes, the
delayed-scaling update, block scaling), `norm_cast` (LayerNorm / RMSNorm writing the
FP8 copy of their output), `act_cast` (activations writing FC2's FP8 input),
`dact_cast` (activation gradients writing FC1's FP8 output gradient and its bias
gradient), the math they share (`common`, `activations`), their launcher (`launch`)
and their `torch.library` registrations (`ops`).

Imported lazily, for CUDA tensors only (or CPU tensors under the Triton interpreter,
``KernelConfig.interpret``); the CPU path never imports this package. Importing this
``__init__`` imports nothing else.
"""
