"""The DeepSpeed engine around the policy: the learner group, the engine, its master weights, and gathers.

The model itself, and the settings settled from it (ZeRO stage, packing,
Liger's kernels), come from :mod:`learners.models`. The DeepSpeed config is
generated from the typed learner config (ZeRO stage, clipping, precision);
``learner.deepspeed_config`` names a JSON file that replaces it for users who
want full control. The optimizer is torch's AdamW (fused on GPU), which keeps
CPU runs free of DeepSpeed's JIT-compiled ops.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import tempfile
from collections.abc import Iterator

import torch

from asyncrl.config import LearnerConfig, ModelConfig
from asyncrl.weights.adapters import with_adapter
from learners import models
from learners.compiled import compile_layers
from learners.masters import set_master_weights
from learners.models import DTYPES, apply_liger, load_causal_lm, resolve_packing, use_liger, zero_stage
from learners.packing import check_packable, packed_attention_inputs

log = logging.getLogger(__name__)


def skip_cpu_shm_comm_build() -> None:
    """Keep DeepSpeed from JIT-compiling its CPU shared-memory all-reduce op.

    On the CPU accelerator, ``deepspeed.comm`` builds ``deepspeed_shm_comm``
    with g++ on first use (about 100 s on two cores). It only speeds up
    intra-node all-reduce on CPU; gloo does the same job correctly. DeepSpeed
    reads compatibility from ``deepspeed.ops.__compatible_ops__`` before it
    builds, so marking the op incompatible makes it fall back to gloo.
    Set ``ASYNCRL_DS_SHM_COMM=1`` to build and use it anyway.
    """
    import deepspeed.ops

    if os.environ.get("ASYNCRL_DS_SHM_COMM") == "1" or torch.cuda.is_available():
        return
    ops = deepspeed.ops.__compatible_ops__
    if "deepspeed_shm_comm" not in ops:
        raise RuntimeError("deepspeed.ops.__compatible_ops__ has no 'deepspeed_shm_comm': update this patch")
    ops["deepspeed_shm_comm"] = False


def init_distributed() -> tuple[int, int]:
    """Join the learner group (torchrun sets the env) or form a group of one.

    A group of one rendezvous through a file, not a TCP port: a port picked
    as free can be taken by any outgoing connection before the store binds it.
    """
    import deepspeed
    import torch.distributed as dist

    if dist.is_initialized():  # joined already (a second engine in one process): same group, no new store
        return dist.get_rank(), dist.get_world_size()
    skip_cpu_shm_comm_build()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if all(key in os.environ for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):  # torchrun
        deepspeed.init_distributed(dist_backend=backend)
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    os.environ.setdefault("LOCAL_RANK", "0")
    global _rendezvous_file
    _rendezvous_file = tempfile.NamedTemporaryFile(prefix="asyncrl-dist-", delete=False).name
    os.unlink(_rendezvous_file)  # the file store creates it
    atexit.register(_remove_rendezvous_file)  # a learner that stops on an error leaves no file in /tmp either
    deepspeed.init_distributed(
        dist_backend=backend, init_method=f"file://{_rendezvous_file}", rank=0, world_size=1, auto_mpi_discovery=False
    )
    return 0, 1


_rendezvous_file: str | None = None  # a group of one's file store


def _remove_rendezvous_file() -> None:
    if _rendezvous_file is not None and os.path.exists(_rendezvous_file):
        os.unlink(_rendezvous_file)


def shutdown_distributed() -> None:
    """Leave the learner group: its communicators are torn down now, not by the interpreter's teardown."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    _remove_rendezvous_file()


def deepspeed_config(config: LearnerConfig, model: ModelConfig) -> dict:
    """The DeepSpeed config implied by the typed learner config."""
    if config.deepspeed_config:
        with open(config.deepspeed_config) as f:
            return json.load(f)
    bucket = config.zero_bucket_elements
    dtype = model.resolved_dtype()
    stage = zero_stage(config, dtype)
    zero: dict = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": bucket}
    if stage == 3:
        # Prefetch the next layers' shards while this one computes, and keep small
        # parameters (norms, biases) whole: gathering them costs more than it saves.
        zero.update(
            stage3_prefetch_bucket_size=bucket,
            stage3_max_live_parameters=4 * bucket,
            stage3_param_persistence_threshold=config.zero_persistence_threshold,
            stage3_module_granularity_threshold=config.zero_module_granularity,
            stage3_use_all_reduce_for_fetch_params=config.zero_allreduce_fetch,
            stage3_gather_16bit_weights_on_model_save=False,
        )
    # One rank at stage 1 with bf16 weights and fp32 gradient accumulation is DeepSpeed's bf16 optimizer (flat
    # buffers); on several ranks stage 1 stays its ZeRO optimizer, which partitions the gradients.
    lone = stage == 1 and dtype == "bfloat16" and models.world_size() == 1
    accumulate = {"data_types": {"grad_accum_dtype": "fp32"}} if lone else {}
    return {
        "train_micro_batch_size_per_gpu": 1,  # micro-batches are formed by token budget, not count
        "gradient_accumulation_steps": 1,
        "gradient_clipping": config.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": dtype == "bfloat16"},
        "fp16": {"enabled": dtype == "float16"},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        **accumulate,
    }


class PolicyLogprobs(torch.nn.Module):
    """Wraps an HF causal LM so one forward call returns token log-probs.

    The engine must see a single root module whose forward does all the
    work, so that ZeRO-3's parameter fetch hooks see every submodule call.
    """

    def __init__(self, model: torch.nn.Module, chunk_tokens: int) -> None:
        super().__init__()
        self.model = model
        self.chunk_tokens = chunk_tokens
        from learners.loss import LogitsHead

        self.head = LogitsHead.of(model.config)

    def forward(
        self,
        input_ids,
        attention_mask,
        targets,
        temperature: float = 1.0,
        position_ids=None,
        entropy_grad: bool = False,
        predicting=None,
        prefix=None,
    ):
        """Log-probs (and entropy) of ``targets``; see :func:`learners.loss.token_logprobs`.

        Packed rows pass ``position_ids`` that restart at 0 for every sample and
        no ``attention_mask``: transformers then confines attention to each
        sample (block-diagonal causal masks; varlen kernels with flash attention).
        ``predicting`` (:attr:`learners.packing.MicroBatch.predicting`): the flat positions whose log-probs are wanted;
        only they go through the output projection and the log-softmax, and the others read 0. A prompt is
        context, so on a step of short answers to long prompts this spares most of the vocabulary's work.
        ``prefix`` (:class:`learners.layout.SharedPrefixes`): a packed row whose prompts appear once.
        """
        from learners.loss import token_logprobs

        attention = packed_attention_inputs(self.model.config, attention_mask, position_ids, prefix)
        hidden = self.model.get_decoder()(
            input_ids=input_ids, position_ids=position_ids, use_cache=False, **attention
        ).last_hidden_state
        head = self.model.get_output_embeddings()
        if predicting is None:
            return token_logprobs(head, hidden, targets, temperature, self.chunk_tokens, entropy_grad, self.head)
        picked, entropy = token_logprobs(
            head,
            hidden.reshape(-1, hidden.shape[-1]).index_select(0, predicting),
            targets.reshape(-1).index_select(0, predicting),
            temperature,
            self.chunk_tokens,
            entropy_grad,
            self.head,
        )
        return tuple(
            values.new_zeros(targets.numel()).index_copy(0, predicting, values).view(targets.shape)
            for values in (picked, entropy)
        )


def adamw(module: torch.nn.Module, config: LearnerConfig, lr: float) -> torch.optim.AdamW:
    """The learner's optimizer for ``module``: torch's fused AdamW, on a GPU and on CPU alike (torch's default on
    CPU is a loop over the tensors, several times slower for a model of hundreds of them)."""
    return torch.optim.AdamW(
        [p for p in module.parameters() if p.requires_grad],  # a LoRA learner's frozen base is left out
        lr=lr,
        betas=tuple(config.betas),
        weight_decay=config.weight_decay,
        fused=True,
    )


def build_engine(config: LearnerConfig, model_config: ModelConfig, logprob_chunk_tokens: int = 1024):
    """Load the policy and wrap it in a DeepSpeed engine; returns (engine, hf_model).

    Settles ``learner.pack_sequences: auto`` in ``config`` first (:func:`resolve_packing`), so that the
    reference, the critic and the trainer, built from the same ``config`` after it, see the same answer.
    With ``learner.lora`` the model gets a fresh adapter and only the adapter trains; ``hf_model`` is then
    the peft model (the engine runs the base model, with the adapter in its layers).
    """
    import deepspeed
    from transformers.integrations import HfDeepSpeedConfig

    resolve_packing(config, model_config)
    models.prompts_shared(config)  # a share_prompts that cannot hold is an error now, not at the first step
    ds_config = deepspeed_config(config, model_config)
    dtype = DTYPES[model_config.resolved_dtype()]
    # While this object is alive, from_pretrained partitions ZeRO-3 parameters as
    # it creates them (zero.Init), so no rank ever holds the full model.
    hf_ds_config = HfDeepSpeedConfig(ds_config)  # noqa: F841
    model = load_causal_lm(config, model_config, random_init=model_config.random_init)
    if config.pack_sequences:
        check_packable(model.config)  # at start, rather than at the first step
    if use_liger(config, model.config.model_type):
        apply_liger(model)
        log.info("learner: Liger's kernels in the policy (%s)", model.config.model_type)
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    trained = with_adapter(model, config.lora, config.disable_dropout) if config.lora.enabled else model
    if config.compile:
        log.info("learner.compile: %d decoder layers compiled at their first call", compile_layers(model))
    wrapper = PolicyLogprobs(model, logprob_chunk_tokens)
    engine, *_ = deepspeed.initialize(model=wrapper, optimizer=adamw(wrapper, config, config.lr), config=ds_config)
    restart_step_counts(engine)
    skip_lone_allreduce(engine)
    if not model_config.random_init and dtype != torch.float32 and not config.lora.enabled:
        set_master_weights(engine, dict(model.named_parameters()), model_config.path)
    return engine, trained


class AdapterOff:
    """The reference of a LoRA learner: the policy's engine with its adapter off, which is the starting policy
    (the frozen base) without a second copy of its weights."""

    def __init__(self, engine, peft_model) -> None:
        self.engine, self.peft_model = engine, peft_model

    def __call__(self, *args, **kwargs):
        with torch.no_grad(), self.peft_model.disable_adapter():
            return self.engine(*args, **kwargs)


def restart_step_counts(engine) -> None:
    """Set the optimizer's step counts back to 0 after DeepSpeed's start.

    DeepSpeed's 16-bit optimizer without ZeRO (one GPU's default) creates
    AdamW's state by taking a step with zero gradients: the moments stay zero
    but the step count becomes 1, so the first real update is corrected as a
    second one and comes out at 0.74 of AdamW's (then 0.86, 0.91, ... at
    betas (0.9, 0.99)), where an fp32 learner's plain AdamW starts at 1.
    """
    optimizer = getattr(engine.optimizer, "optimizer", engine.optimizer)
    for state in getattr(optimizer, "state", {}).values():
        if torch.is_tensor(state.get("step")):
            state["step"].zero_()
        elif "step" in state:
            state["step"] = 0


def skip_lone_allreduce(engine) -> None:
    """Without ZeRO, and with its bf16 optimizer (which holds the gradients itself before any reduction),
    DeepSpeed all-reduces gradients after every backward, even in a group of one."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    holds_gradients = engine.zero_optimization_stage() == 0 or isinstance(engine.optimizer, BF16_Optimizer)
    if holds_gradients and engine.world_size == 1:
        engine.enable_backward_allreduce = False


def build_reference(config: LearnerConfig, model_config: ModelConfig, logprob_chunk_tokens: int = 1024):
    """A frozen copy of the starting policy for the KL penalty, partitioned like the policy.

    Inference only: no optimizer, no gradients; under ZeRO-3 each rank holds
    a shard, gathered layer by layer in its forward like the policy's.
    """
    import deepspeed
    from transformers.integrations import HfDeepSpeedConfig

    ds_config = deepspeed_config(config, model_config)
    if ds_config["zero_optimization"]["stage"] < 3:  # stages 1 and 2 partition optimizer state: it has none
        ds_config = {**ds_config, "zero_optimization": {"stage": 0}}
        ds_config.pop("data_types", None)
    hf_ds_config = HfDeepSpeedConfig(ds_config)  # noqa: F841  (partitions at creation, as above)
    model = load_causal_lm(config, model_config)
    model.requires_grad_(False)
    engine, *_ = deepspeed.initialize(model=PolicyLogprobs(model, logprob_chunk_tokens), config=ds_config)
    engine.eval()
    return engine


def grad_norm_of(module: torch.nn.Module) -> float:
    """The 2-norm of ``module``'s gradients, as clipping sees it (before clipping)."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0


def gathered_parameters(
    model: torch.nn.Module, bucket_bytes: int = 256 * 2**20, device: str | torch.device = "cpu", copy: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, full tensor)`` for every parameter, gathering ZeRO-3 shards in buckets.

    A bucket of parameters is gathered with one collective, copied to CPU and
    released before the next, so neither the network sees one call per
    parameter nor any rank holds the whole model at once. Every rank must
    iterate (gathering is collective); only rank 0 needs the tensors. Each
    tensor is a copy on ``device`` (the GPU, for a push over NCCL); with
    ``copy=False``, a tensor already there may be the parameter itself (or,
    under ZeRO-3, its gathered data), valid until the next is requested.
    """
    import deepspeed

    params = list(model.named_parameters())
    bucket: list[tuple[str, torch.nn.Parameter]] = []
    size = 0
    for i, (name, param) in enumerate(params):
        bucket.append((name, param))
        size += (getattr(param, "ds_numel", None) or param.numel()) * param.element_size()
        if size < bucket_bytes and i + 1 < len(params):
            continue
        partitioned = [p for _, p in bucket if hasattr(p, "ds_id")]
        with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None, enabled=bool(partitioned)):
            for n, p in bucket:
                yield n, p.detach().to(device, copy=copy)
        bucket, size = [], 0
