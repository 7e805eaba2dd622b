"""What the Megatron Core tests share: the skip mark, a deadline for every test that
drives Megatron, a one-rank gloo group with Megatron's parallel state and its devices
pinned to the CPU, and a small GPT (dense, or Mixture-of-Experts with grouped experts)
built from Megatron's Transformer Engine layer spec and trained in FP8 through
Megatron's own FP8 context.

Megatron Core is installed by qa/make_venv.sh with the test extras (docs/megatron.md).
"""

import faulthandler
import importlib.util
import signal
import sys
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist

import transformer_engine.pytorch as te
from helpers import capture

needs_megatron = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None
    or importlib.util.find_spec("megatron.core") is None,
    reason="megatron-core is not installed (qa/make_venv.sh installs it: pip install --no-deps "
           "--ignore-requires-python -r qa/megatron_requirements.txt)")

CLIENT_TIMEOUT_S = 150
"""How long one test may drive Megatron before it fails as a hang (each takes seconds;
a stalled collective or worker, such as dist_checkpointing's save without psutil,
would otherwise stall CI for good)."""

HARD_TIMEOUT_GRACE_S = 30
"""If the test is stuck inside a call that never returns to Python (where the deadline's
exception cannot be raised), the process dumps every thread's stack and exits this long
after the deadline: the file fails, CI goes on."""


class ClientTimeout(Exception):
    """A test that drives Megatron ran past its deadline."""


def deadline(seconds: float, what: str, grace: float = HARD_TIMEOUT_GRACE_S):
    """Arm a deadline for the running test: a `ClientTimeout` ``seconds`` from now in the
    main thread (SIGALRM), and a dump of every thread's stack and a process exit
    ``grace`` seconds later; returns the function that disarms both and restores the
    previous SIGALRM handler."""
    def expire(signum, frame):
        raise ClientTimeout(f"{what}: did not finish within {seconds} s (a hang in the client?)")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    faulthandler.dump_traceback_later(seconds + grace, exit=True, file=sys.stderr)

    def disarm():
        signal.setitimer(signal.ITIMER_REAL, 0)
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGALRM, previous)
    return disarm


@pytest.fixture
def client_deadline(request):
    """Every test that drives Megatron runs under `deadline(CLIENT_TIMEOUT_S)`."""
    disarm = deadline(CLIENT_TIMEOUT_S, request.node.nodeid)
    try:
        yield
    finally:
        disarm()


class _CpuOnlyCuda:
    """``torch.cuda`` as the CUDA-bound Megatron modules see it in these tests: no CUDA
    device (``is_available()`` False, ``current_device()`` "cpu"); all else is torch's."""

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def is_available():
        return False

    @staticmethod
    def current_device():
        return "cpu"


class _TorchOnCpu:
    """``torch`` with `_CpuOnlyCuda` as its ``cuda``."""

    cuda = _CpuOnlyCuda()

    def __getattr__(self, name):
        return getattr(torch, name)


CUDA_BOUND_PACKAGES = ("megatron.core.transformer.moe", "megatron.core.dist_checkpointing")
"""Megatron packages written for CUDA that these CPU tests run: the MoE router moves a
CPU weight to ``torch.cuda.current_device()`` and makes its loss tensors there (its
metrics tracker too, where CUDA is available); the checkpoint saver broadcasts its
failure flag from a tensor on ``torch.cuda.current_device()``."""


def pin_cuda_bound_modules_to_cpu(monkeypatch):
    """Answer the device look-ups of the modules of `CUDA_BOUND_PACKAGES` with "cpu", on
    every machine: without CUDA they would raise, and on a machine with a GPU they would
    put the router weight on cuda:0 next to CPU activations. Only those modules see the
    change (each gets its own ``torch`` name), and only for the test."""
    import megatron.core.dist_checkpointing.strategies.state_dict_saver  # noqa: F401
    import megatron.core.models.gpt  # noqa: F401  (loads the MoE modules)

    for name, module in list(sys.modules.items()):
        if any(name == p or name.startswith(p + ".") for p in CUDA_BOUND_PACKAGES) \
                and getattr(module, "torch", None) is torch:
            monkeypatch.setattr(module, "torch", _TorchOnCpu())


@pytest.fixture
def megatron_on_cpu(tmp_path, monkeypatch, client_deadline):
    """A one-rank gloo group and Megatron's parallel state over it, a fresh Megatron RNG
    tracker (a recompute's RNG replay calls its set_states, which marks it initialized
    for every model built later), Megatron's CUDA-bound modules pinned to the CPU, and
    the TE extra-state encoder's device synchronization answered on a machine without
    CUDA; all undone after, under the client deadline."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    pin_cuda_bound_modules_to_cpu(monkeypatch)
    if not torch.cuda.is_available():
        # Megatron's TEGroupedLinear._encode_extra_state calls torch.cuda.synchronize()
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)
    initialize_rng_tracker(force_reset=True)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        parallel_state.initialize_model_parallel(1, 1)
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        initialize_rng_tracker(force_reset=True)


# ---- a small GPT --------------------------------------------------------------------------

VOCAB, SEQ, BATCH, HIDDEN, EXPERTS = 128, 16, 2, 64, 2


def gpt_config(moe: bool = False, recompute: bool = False, fp8_param: bool = False,
               fp8_recipe: str = "delayed"):
    """A 2-layer GPT's TransformerConfig: FP8 hybrid, Megatron's ``fp8_recipe`` (delayed
    scaling with history 4 by default; "mxfp8" is ``--fp8-recipe mxfp8``), CPU
    initialization in float32, no dropout; ``moe``: 2 experts a layer as grouped GEMMs
    (top-1 routing, allgather dispatch); ``recompute``: full activation recompute of
    every layer (which Megatron routes through te.distributed.checkpoint);
    ``fp8_param``: the TE layers built under ``fp8_model_init`` (FP8 primary weights)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    extra = ({"recompute_granularity": "full", "recompute_method": "uniform",
              "recompute_num_layers": 1} if recompute else {})
    if moe:
        extra.update(num_moe_experts=EXPERTS, moe_grouped_gemm=True, moe_router_topk=1,
                     moe_router_pre_softmax=True, moe_token_dispatcher_type="allgather",
                     moe_ffn_hidden_size=HIDDEN, add_bias_linear=False)
    return TransformerConfig(
        num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, use_cpu_initialization=True,
        params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
        fp8="hybrid", fp8_recipe=fp8_recipe, fp8_amax_history_len=4, fp8_param=fp8_param,
        **extra)


def gpt_model(config):
    """Megatron's GPTModel from its TE layer spec (with grouped experts for an MoE
    config). With ``fp8_param`` Megatron's TransformerBlock builds each layer under its
    ``fp8_model_init`` context itself."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    moe = config.num_moe_experts is not None
    spec = get_gpt_layer_with_transformer_engine_spec(
        num_experts=config.num_moe_experts, moe_grouped_gemm=moe)
    return GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=2 * SEQ)


def te_modules_of(model) -> list:
    return [m for m in model.modules() if isinstance(m, te.TransformerEngineBaseModule)]


def train(model, config, steps: int, micro_batches: int = 1, seed: int = 1):
    """``steps`` SGD steps of ``micro_batches`` micro-batches each (gradients accumulated;
    ``set_is_first_microbatch()`` before the first, as Megatron's schedule calls it, so
    later micro-batches reuse the FP8 weights cast in the first), each forward in
    Megatron's FP8 context. One `capture` record per step (the last micro-batch's
    loss, the gradients, every TE module's FP8 state)."""
    from megatron.core import fp8_utils

    te_modules = te_modules_of(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.1)
    gen = torch.Generator().manual_seed(seed)
    record = []
    for _ in range(steps):
        model.set_is_first_microbatch()
        for _ in range(micro_batches):
            tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
            labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
            positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
            with fp8_utils.get_fp8_context(config):
                loss = model(tokens, positions, attention_mask=None, labels=labels).float().mean()
            (loss / micro_batches).backward()
        record.append(capture(loss, [], params, te_modules))
        opt.step()
        opt.zero_grad()
    return record


class Run(NamedTuple):
    record: list        # one `capture` record per step
    layer_calls: int    # how often a decoder layer's forward ran (recomputes included)
    model: torch.nn.Module


def counted_run(config, steps: int = 3, micro_batches: int = 1, on_build=None) -> Run:
    """Build the GPT of ``config`` from seed 0 (``on_build(model)`` then, to hook it),
    count its decoder layers' forwards and train it."""
    torch.manual_seed(0)
    model = gpt_model(config)
    if on_build is not None:
        on_build(model)
    calls = [0]
    for layer in model.decoder.layers:
        layer.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    record = train(model, config, steps, micro_batches)
    return Run(record, calls[0], model)


def fp8_weight_bits(model) -> list:
    """The FP8 bits of every FP8 primary weight of ``model``, in parameter order."""
    from megatron.core import fp8_utils

    return [p._data.view(torch.uint8).clone() for p in model.parameters()
            if fp8_utils.is_float8tensor(p)]
