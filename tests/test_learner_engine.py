"""The DeepSpeed engine on one CPU rank: partitioning, log-probs, accumulation, export."""

import pytest
import torch
from conftest import ROOT
from transformers import AutoModelForCausalLM

from asyncrl.config import LearnerConfig, ModelConfig

MODEL = str(ROOT / "assets/tiny-llama")


@pytest.fixture(scope="module")
def engine_and_model():
    from learners.engine import build_engine, init_distributed

    init_distributed()
    return build_engine(LearnerConfig(lr=1e-2, zero_stage=3), ModelConfig(path=MODEL), logprob_chunk_tokens=5)


def _reference_logprobs(model, ids):
    targets = torch.roll(ids, -1, 1)
    with torch.no_grad():
        return torch.log_softmax(model(ids).logits.float(), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def test_parameters_are_zero3_partitioned(engine_and_model):
    _, model = engine_and_model
    params = list(model.parameters())
    assert all(hasattr(p, "ds_id") for p in params)
    # Outside a gather, a ZeRO-3 parameter holds only its shard, not the full tensor.
    assert all(p.numel() == 0 for p in params)
    assert sum(p.ds_numel for p in params) == sum(
        p.numel() for p in AutoModelForCausalLM.from_pretrained(MODEL).parameters()
    )


def test_engine_logprobs_match_transformers(engine_and_model):
    engine, _ = engine_and_model
    ref = AutoModelForCausalLM.from_pretrained(MODEL)
    ids = torch.randint(3, 14, (3, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        lp, _ = engine(ids, torch.ones_like(ids), torch.roll(ids, -1, 1))
    assert (lp - _reference_logprobs(ref, ids)).abs().max() < 1e-5


def test_microbatches_accumulate_to_one_step_and_export_is_the_full_model(engine_and_model):
    from learners.engine import gathered_parameters

    engine, model = engine_and_model
    start = dict(gathered_parameters(model))
    ref = AutoModelForCausalLM.from_pretrained(MODEL)
    ref.load_state_dict(start)
    ids = torch.randint(3, 14, (4, 8), generator=torch.Generator().manual_seed(1))
    for k, half in enumerate((ids[:2], ids[2:])):
        engine.set_gradient_accumulation_boundary(k == 1)
        lp, _ = engine(half, torch.ones_like(half), torch.roll(half, -1, 1))
        engine.backward(lp.sum() / ids.numel(), scale_wrt_gas=False)
        engine.step()
    optimizer = torch.optim.AdamW(ref.parameters(), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.0)
    targets = torch.roll(ids, -1, 1)
    loss = torch.log_softmax(ref(ids).logits.float(), -1).gather(-1, targets.unsqueeze(-1)).sum() / ids.numel()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    optimizer.step()
    exported = dict(gathered_parameters(model, bucket_bytes=1024))  # many small buckets
    assert exported.keys() == ref.state_dict().keys()
    assert max((exported[k] - v).abs().max().item() for k, v in ref.state_dict().items()) < 1e-4
    assert any((exported[k] - start[k]).abs().max() > 1e-3 for k in start)  # the step did move the weights


def test_reference_stays_at_the_starting_policy(engine_and_model):
    from learners.engine import build_reference

    engine, _ = engine_and_model  # trained by the test above: the policy moved
    reference = build_reference(LearnerConfig(zero_stage=3), ModelConfig(path=MODEL), logprob_chunk_tokens=5)
    assert all(hasattr(p, "ds_id") and not p.requires_grad for p in reference.module.parameters())
    ids = torch.randint(3, 14, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref_lp, _ = reference(ids, torch.ones_like(ids), torch.roll(ids, -1, 1))
    start = _reference_logprobs(AutoModelForCausalLM.from_pretrained(MODEL), ids)
    assert (ref_lp - start).abs().max() < 1e-5


def test_packed_rows_give_the_same_logprobs_as_padded_rows(engine_and_model):
    """Packing puts rollouts back to back in one row; attention must not cross from one to the next."""
    from conftest import make_rollout

    from learners.packing import microbatches, pack

    rollouts = [make_rollout(i, versions=[0] * n) for i, n in enumerate([3, 7, 1, 5])]
    engine, _ = engine_and_model
    results = []
    for packed in (False, True):
        ids, attention, positions, targets, _, mask, adv, _ = pack(rollouts, packed, torch.arange(4.0) + 1)[:8]
        # Each rollout's advantage lands on its own response tokens, packed or not.
        assert sorted(adv[mask.bool()].tolist()) == sorted([1.0] * 3 + [2.0] * 7 + [3.0] * 1 + [4.0] * 5)
        assert ids.shape[0] == (1 if packed else len(rollouts))
        with torch.no_grad():
            lp, entropy = engine(ids, attention, targets, 1.0, positions)
        results.append((lp[mask.bool()], entropy[mask.bool()]))
    (padded, padded_entropy), (packed, packed_entropy) = results
    # Per-token advantages (REINFORCE++) land token by token, in order.
    per_token = [torch.arange(n, dtype=torch.float32) + 10 * i for i, n in enumerate([3, 7, 1, 5])]
    for packed_rows in (False, True):
        batch = pack(rollouts, packed_rows, per_token)
        mask, adv = batch.mask, batch.advantages
        assert adv[mask.bool()].tolist() == torch.cat(per_token).tolist()
    assert padded.numel() == packed.numel() == 16
    assert (padded - packed).abs().max() < 1e-5
    assert (padded_entropy - packed_entropy).abs().max() < 1e-5
    # The packed budget counts tokens, not rows x longest row.
    assert microbatches([10, 10, 10, 40], 60, packed=True) == [[0, 1, 2], [3]]
    assert microbatches([10, 10, 10, 40], 60, packed=False) == [[0, 1, 2], [3]]
    assert microbatches([10, 40, 10], 60, packed=True) == [[0, 2, 1]]


def test_the_critic_starts_at_zero_learns_and_its_checkpoint_restores_it(engine_and_model, tmp_path):
    from asyncrl.config import AlgoConfig
    from learners.critic import build_critic, value_loss

    critic = build_critic(LearnerConfig(zero_stage=3), ModelConfig(path=MODEL), AlgoConfig(critic_lr=1e-2))
    ids = torch.tensor([[1, 5, 6, 7, 2]])
    attention = torch.ones_like(ids)
    with torch.no_grad():
        assert torch.equal(critic(ids, attention), torch.zeros(1, 5)), "a zero head: no prior on the return"
    target = torch.full((1, 5), 0.5)
    for _ in range(5):
        loss = value_loss(critic(ids, attention), torch.zeros(1, 5), target, torch.ones(1, 5), None, 5)
        critic.backward(loss)
        critic.step()
    with torch.no_grad():
        trained = critic(ids, attention)
    assert (trained - 0.5).abs().max() < 0.45, "the values moved towards the returns"
    critic.save_checkpoint(str(tmp_path / "step00000001"), tag="critic", save_latest=False)
    loss = value_loss(critic(ids, attention), torch.zeros(1, 5), -target, torch.ones(1, 5), None, 5)
    critic.backward(loss)
    critic.step()
    with torch.no_grad():
        assert not torch.equal(critic(ids, attention), trained)
    path, _ = critic.load_checkpoint(str(tmp_path / "step00000001"), tag="critic")
    with torch.no_grad():
        assert path is not None and torch.equal(critic(ids, attention), trained)


def test_one_cpu_rank_trains_without_zero_and_its_checkpoint_exports(tmp_path):
    """learner.zero_stage unset: ZeRO-3 with several ranks, none for one fp32 rank (nothing to shard), and
    stage 1 for one bf16 rank (DeepSpeed's bf16 optimizer, whose buffers are flat)."""
    from learners import checkpoint
    from learners.engine import build_engine, grad_norm_of, init_distributed
    from learners.models import zero_stage

    init_distributed()
    config = LearnerConfig(lr=1e-2)
    assert zero_stage(config) == 0 and zero_stage(LearnerConfig(zero_stage=3)) == 3
    assert zero_stage(config, "bfloat16") == 1 and zero_stage(config, "float32") == 0
    assert zero_stage(LearnerConfig(zero_stage=0), "bfloat16") == 0  # set, it stands
    engine, model = build_engine(config, ModelConfig(path=MODEL), logprob_chunk_tokens=5)
    assert not any(hasattr(p, "ds_id") for p in model.parameters())
    assert not engine.enable_backward_allreduce  # a group of one has nothing to reduce
    ref = AutoModelForCausalLM.from_pretrained(MODEL)
    ids = torch.randint(3, 14, (4, 8), generator=torch.Generator().manual_seed(2))
    lp, _ = engine(ids, torch.ones_like(ids), torch.roll(ids, -1, 1))
    engine.backward(lp.sum() / ids.numel(), scale_wrt_gas=False)
    norm = grad_norm_of(engine.module)  # DeepSpeed reports none for fp32 without ZeRO: the learner logs this
    engine.step()
    optimizer = torch.optim.AdamW(ref.parameters(), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.0)
    (_train_logprobs(ref, ids).sum() / ids.numel()).backward()
    assert norm == pytest.approx(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)), rel=1e-4)
    optimizer.step()
    trained = model.state_dict()
    assert max((trained[k] - v).abs().max().item() for k, v in ref.state_dict().items()) < 1e-4
    checkpoint.save(engine, tmp_path / "checkpoints", 1, None, 0, keep=2)
    exported = AutoModelForCausalLM.from_pretrained(
        checkpoint.export_hf(tmp_path / "checkpoints", None, MODEL, tmp_path / "export", "float32")
    ).state_dict()
    assert exported.keys() == trained.keys() and all(torch.equal(exported[k], v) for k, v in trained.items())


def _train_logprobs(model, ids):
    targets = torch.roll(ids, -1, 1)
    return torch.log_softmax(model(ids).logits.float(), -1).gather(-1, targets.unsqueeze(-1))


def test_one_bf16_rank_keeps_fp32_master_weights_and_its_checkpoint_exports(tmp_path):
    """The single-GPU default (bf16, DeepSpeed's bf16 optimizer), on CPU: updates smaller than bf16's resolution
    still add up in the fp32 master weights, the checkpoint exports the bf16 model it trained, and a learner
    resumed from it holds the same master weights."""
    from learners import checkpoint
    from learners.engine import build_engine, init_distributed
    from learners.masters import master_weight

    init_distributed()
    engine, model = build_engine(
        LearnerConfig(lr=1e-6), ModelConfig(path=MODEL, dtype="bfloat16"), logprob_chunk_tokens=5
    )
    assert next(model.parameters()).dtype == torch.bfloat16
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(3, 14, (4, 8), generator=torch.Generator().manual_seed(3))
    # Each update (~1e-6) is far below bf16's spacing at a typical weight (~6e-5 at 0.015): plain bf16
    # AdamW moves 2% of the weights in 100 steps, because every update rounds away.
    for _ in range(100):
        lp, _ = engine(ids, torch.ones_like(ids), torch.roll(ids, -1, 1))
        engine.backward(-lp.float().sum() / ids.numel(), scale_wrt_gas=False)
        engine.step()
    trained = model.state_dict()
    moved = sum(int((trained[k] != v).sum()) for k, v in before.items())
    assert moved > 0.5 * sum(v.numel() for v in before.values()), "the bf16 weights follow the fp32 master copy"
    checkpoint.save(engine, tmp_path / "checkpoints", 100, None, 0, keep=2)
    exported = AutoModelForCausalLM.from_pretrained(
        checkpoint.export_hf(tmp_path / "checkpoints", None, MODEL, tmp_path / "export", "bfloat16"),
        dtype=torch.bfloat16,
    ).state_dict()
    assert all(torch.equal(exported[k], v) for k, v in trained.items() if k in exported)
    masters = {name: master_weight(engine, p) for name, p in model.named_parameters()}
    resumed, resumed_model = build_engine(
        LearnerConfig(lr=1e-6), ModelConfig(path=MODEL, dtype="bfloat16"), logprob_chunk_tokens=5
    )
    path, _ = resumed.load_checkpoint(str(tmp_path / "checkpoints"), tag=checkpoint.latest(tmp_path / "checkpoints"))
    assert path is not None
    for name, param in resumed_model.named_parameters():
        assert torch.equal(master_weight(resumed, param), masters[name]), name
        assert not torch.equal(masters[name], before[name].float()), name  # trained: the masters moved


def test_bf16_master_weights_start_from_the_fp32_checkpoint():
    """A bf16 learner's fp32 master copy holds the checkpoint's own fp32 values. Built from the bf16 rounding,
    every weight sits on the bf16 grid and a first step smaller than half a grid step changes no weight."""
    from safetensors.torch import load_file

    from learners.engine import build_engine, init_distributed
    from learners.masters import master_weight, set_master_weight

    init_distributed()
    stored = load_file(f"{MODEL}/model.safetensors")
    ids = torch.randint(3, 14, (4, 8), generator=torch.Generator().manual_seed(4))

    def weights_moved_by_one_step(rounded_master: bool) -> int:
        engine, model = build_engine(
            LearnerConfig(lr=7e-6), ModelConfig(path=MODEL, dtype="bfloat16"), logprob_chunk_tokens=5
        )
        for name, param in model.named_parameters():
            assert torch.equal(master_weight(engine, param).cpu(), stored[name]), name
            if rounded_master:  # what DeepSpeed builds from the bf16 model on its own
                assert set_master_weight(engine, param, stored[name].bfloat16().float())
        before = {k: v.clone() for k, v in model.state_dict().items()}
        lp, _ = engine(ids, torch.ones_like(ids), torch.roll(ids, -1, 1))
        engine.backward(-lp.float().sum() / ids.numel(), scale_wrt_gas=False)
        engine.step()
        return sum(int((model.state_dict()[k] != v).sum()) for k, v in before.items())

    from_fp32, from_rounded = weights_moved_by_one_step(False), weights_moved_by_one_step(True)
    total = sum(v.numel() for v in stored.values())
    # A weight of ~0.015 has a bf16 step of 6e-5: a first update of 7e-6 (Adam's first moves each weight by
    # lr) crosses a rounding boundary for ~1 in 6 weights when they start anywhere in their step, and only for
    # the smallest ones when they start on it (measured: 20% against 8% of this model's weights).
    assert from_fp32 > 0.1 * total
    assert from_fp32 > 2 * from_rounded


def test_zero3_bf16_master_weights_start_from_the_fp32_checkpoint():
    """Under ZeRO-3 each rank's fp32 partition is set from the checkpoint's fp32 tensor, not its bf16 rounding."""
    from safetensors.torch import load_file

    from learners.engine import build_engine, init_distributed
    from learners.masters import master_weight

    init_distributed()
    stored = load_file(f"{MODEL}/model.safetensors")
    engine, model = build_engine(
        LearnerConfig(lr=1e-5, zero_stage=3), ModelConfig(path=MODEL, dtype="bfloat16"), logprob_chunk_tokens=5
    )
    assert all(hasattr(p, "ds_id") for p in model.parameters())
    for name, param in model.named_parameters():
        master = master_weight(engine, param).cpu().view_as(stored[name])
        assert torch.equal(master, stored[name]), name
        rounded = stored[name].bfloat16().float()
        if not torch.equal(rounded, stored[name]):  # norm weights of 1.0 are exact in bf16
            assert not torch.equal(master, rounded), name


def test_a_bf16_critic_starts_its_decoder_master_weights_from_the_fp32_checkpoint():
    from safetensors.torch import load_file

    from asyncrl.config import AlgoConfig
    from learners.critic import build_critic
    from learners.engine import init_distributed
    from learners.masters import master_weight

    init_distributed()
    stored = load_file(f"{MODEL}/model.safetensors")
    critic = build_critic(LearnerConfig(), ModelConfig(path=MODEL, dtype="bfloat16"), AlgoConfig())
    checked = 0
    for name, param in critic.module.decoder.named_parameters():
        assert torch.equal(master_weight(critic, param).cpu(), stored[f"model.{name}"]), name
        checked += 1
    assert checked == sum(1 for k in stored if k.startswith("model."))


# ---------------------------------------------------------------- Liger's kernels (learner.liger_kernels)


@pytest.fixture
def fake_liger(monkeypatch):
    """A stand-in for liger_kernel.transformers.monkey_patch (the real one needs Triton): records each patch call."""
    import importlib.util
    import sys
    import types

    calls = []

    def apply_to_llama(
        rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=True, model=None
    ):
        calls.append(
            dict(
                rope=rope,
                rms_norm=rms_norm,
                swiglu=swiglu,
                cross_entropy=cross_entropy,
                fused_linear_cross_entropy=fused_linear_cross_entropy,
                model=model,
            )
        )

    def apply_to_gemma(rope=True, rms_norm=True, geglu=True, model=None):  # no swiglu or cross-entropy switches
        calls.append(dict(rope=rope, rms_norm=rms_norm, model=model))

    patch = types.ModuleType("liger_kernel.transformers.monkey_patch")
    patch.MODEL_TYPE_TO_APPLY_LIGER_FN = {"llama": apply_to_llama, "gemma": apply_to_gemma}
    package = types.ModuleType("liger_kernel.transformers")
    package.monkey_patch = patch
    root = types.ModuleType("liger_kernel")
    root.transformers = package
    monkeypatch.setitem(sys.modules, "liger_kernel", root)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", package)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", patch)
    found = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "liger_kernel" else found(name, *a)
    )
    return calls


def test_liger_patches_norms_mlp_and_rope_but_leaves_the_chunked_loss(fake_liger):
    from learners.models import apply_liger

    model = AutoModelForCausalLM.from_pretrained(MODEL)
    apply_liger(model)
    assert fake_liger == [
        dict(rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False, model=model)
    ]


def test_liger_passes_only_the_switches_a_model_types_patch_takes(fake_liger):
    from learners.models import apply_liger

    model = AutoModelForCausalLM.from_pretrained(MODEL)
    model.config.model_type = "gemma"
    apply_liger(model)
    assert fake_liger == [dict(rope=True, rms_norm=True, model=model)]


def test_liger_refuses_a_model_type_it_has_no_kernels_for(fake_liger):
    from learners.models import apply_liger

    model = AutoModelForCausalLM.from_pretrained(MODEL)
    model.config.model_type = "qwen9"
    with pytest.raises(ValueError, match=r"learner.liger_kernels: Liger has no kernels for model type 'qwen9'"):
        apply_liger(model)
    assert fake_liger == [], "nothing half-patched"


def test_liger_kernels_auto_turn_on_only_where_a_gpu_the_package_and_the_model_type_are(fake_liger, monkeypatch):
    from learners.models import use_liger

    assert LearnerConfig().liger_kernels == "auto"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert use_liger(LearnerConfig(), "llama") is False  # no GPU: auto stays off
    with pytest.raises(ValueError, match=r"learner.liger_kernels: true needs a CUDA GPU"):
        use_liger(LearnerConfig(liger_kernels=True), "llama")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert use_liger(LearnerConfig(), "llama") is True
    assert use_liger(LearnerConfig(), "qwen9") is False  # a model type Liger does not cover: auto stays off
    assert use_liger(LearnerConfig(liger_kernels=False), "llama") is False
    assert use_liger(LearnerConfig(liger_kernels=True), "llama") is True
    assert use_liger(LearnerConfig(zero_stage=3), "llama") is False  # not yet run under ZeRO-3 partitioning
    assert use_liger(LearnerConfig(zero_stage=3, liger_kernels=True), "llama") is True


def test_liger_kernels_auto_run_without_a_liger_that_does_not_import(fake_liger, monkeypatch, caplog):
    import learners.models as models

    def broken():
        raise ImportError("cannot import name 'LlamaRMSNorm'")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(models, "_liger_patches", broken)
    assert models.use_liger(LearnerConfig(), "llama") is False
    assert "liger_kernel does not import" in caplog.text


def test_liger_kernels_asked_for_but_not_installed_name_the_key(monkeypatch):
    import importlib.util

    from asyncrl.extras import MissingExtra
    from learners.models import use_liger

    found = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "liger_kernel" else found(name, *a)
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert use_liger(LearnerConfig(), "llama") is False  # auto without the package: off
    with pytest.raises(MissingExtra, match=r"learner.liger_kernels: true needs liger_kernel"):
        use_liger(LearnerConfig(liger_kernels=True), "llama")


def test_pack_sequences_auto_settles_to_padded_rows_without_a_gpu_and_keeps_an_explicit_choice(monkeypatch):
    from learners.models import resolve_packing

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = LearnerConfig()
    assert config.pack_sequences == "auto"
    resolve_packing(config, ModelConfig(path=MODEL))
    assert config.pack_sequences is False and config.attn_implementation is None
    asked = LearnerConfig(attn_implementation="varlen")  # on a CPU: padded rows, each through sdpa
    resolve_packing(asked, ModelConfig(path=MODEL))
    assert asked.pack_sequences is False and asked.attn_implementation == "varlen"
    explicit = LearnerConfig(pack_sequences=True, attn_implementation="flex_attention")
    resolve_packing(explicit, ModelConfig(path=MODEL))
    assert explicit.pack_sequences is True and explicit.attn_implementation == "flex_attention"


def test_pack_sequences_auto_packs_under_varlen_on_a_gpu_with_bf16_weights(monkeypatch):
    """The GPU answer, decided on this machine by standing in for the device checks; tests/test_gpu_one_gpu_run.py
    trains under it on a GPU."""
    import learners.attention
    from learners.models import resolve_packing

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(learners.attention, "_varlen_options", lambda: frozenset({"scale", "window_size"}))
    config = LearnerConfig()
    resolve_packing(config, ModelConfig(path=MODEL, dtype="bfloat16"))
    assert config.pack_sequences is True and config.attn_implementation == "varlen"
    fp32 = LearnerConfig()
    resolve_packing(fp32, ModelConfig(path=MODEL, dtype="float32"))
    assert fp32.pack_sequences is False
    with pytest.raises(ValueError, match="learner.attn_implementation varlen: model.dtype float32"):
        resolve_packing(LearnerConfig(attn_implementation="varlen"), ModelConfig(path=MODEL, dtype="float32"))
    monkeypatch.setattr(learners.attention, "_varlen_options", lambda: frozenset({"scale"}))  # an older torch
    resolve_packing(older_torch := LearnerConfig(), ModelConfig(path=MODEL, dtype="bfloat16"))
    assert older_torch.pack_sequences is False
    monkeypatch.setattr(learners.attention, "_varlen_options", lambda: frozenset({"scale", "window_size"}))
    older = LearnerConfig()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 5))
    resolve_packing(older, ModelConfig(path=MODEL, dtype="bfloat16"))
    assert older.pack_sequences is False


def test_varlen_asked_for_a_model_with_sliding_window_layers_is_refused_at_start(tmp_path):
    """varlen applies no window: the learner says so before loading the model, not at its first step."""
    from transformers import Qwen2Config

    from learners.models import resolve_packing

    Qwen2Config(
        use_sliding_window=True,
        sliding_window=16,
        num_hidden_layers=2,
        max_window_layers=1,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
    ).save_pretrained(tmp_path)
    for pack in ("auto", False):
        with pytest.raises(ValueError, match="attn_implementation varlen: qwen2 has sliding-window attention"):
            resolve_packing(
                LearnerConfig(attn_implementation="varlen", pack_sequences=pack), ModelConfig(path=str(tmp_path))
            )
    padded = LearnerConfig()  # auto without asking for varlen: padded rows under the model's own attention
    resolve_packing(padded, ModelConfig(path=str(tmp_path)))
    assert padded.pack_sequences is False and padded.attn_implementation is None


def test_a_learner_group_of_one_is_left_with_no_communicator_and_no_file(tmp_path):
    """The learner tears its group down itself (learners.engine.shutdown_distributed), and its rendezvous
    file in the temporary folder goes with it. Joining again in the same process (tests and benchmarks build
    several engines in one) reuses the group and leaves no second file behind."""
    import os
    import subprocess
    import sys

    code = (
        "import os, torch.distributed as dist\n"
        "from learners import engine\n"
        "engine.init_distributed()\n"
        "path = engine._rendezvous_file\n"
        "dist.barrier()\n"
        "assert dist.is_initialized() and os.path.exists(path), path\n"
        "assert engine.init_distributed() == (0, 1) and engine._rendezvous_file == path\n"  # joined: no new store
        "assert len(os.listdir(os.path.dirname(path))) == 1, os.listdir(os.path.dirname(path))\n"
        "engine.shutdown_distributed()\n"
        "assert not dist.is_initialized() and not os.path.exists(path), path\n"
    )
    env = {**os.environ, "TMPDIR": str(tmp_path), "DS_ACCELERATOR": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert not list(tmp_path.glob("asyncrl-dist-*"))


@pytest.fixture(scope="module")
def gpt2_with_dropout(tmp_path_factory) -> str:
    """A tiny GPT-2 folder with GPT-2's default dropout (resid, embd and attn_pdrop 0.1)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path_factory.mktemp("gpt2-dropout")
    torch.manual_seed(0)
    GPT2LMHeadModel(
        GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50, n_positions=32, bos_token_id=1, eos_token_id=2)
    ).save_pretrained(folder)
    return str(folder)


def _two_train_passes(model) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of one batch from two forward passes in train mode, as the learner's step runs them."""
    from learners.engine import PolicyLogprobs

    wrapper = PolicyLogprobs(model, chunk_tokens=1024).train()
    ids = torch.randint(3, 14, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return tuple(wrapper(ids, torch.ones_like(ids), torch.roll(ids, -1, 1))[0] for _ in range(2))


def test_the_learner_loads_models_without_dropout_so_train_mode_log_probs_are_deterministic(gpt2_with_dropout):
    """The generators sample with no dropout; with it, the learner's log-probs moved by up to 0.3 between passes."""
    from learners.models import load_causal_lm

    for random_init in (False, True):
        model = load_causal_lm(LearnerConfig(), ModelConfig(path=gpt2_with_dropout), random_init=random_init)
        dropouts = [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]
        assert dropouts and all(m.p == 0.0 for m in dropouts)
        assert model.config.attn_pdrop == model.config.resid_pdrop == model.config.embd_pdrop == 0.0
        first, second = _two_train_passes(model)
        assert torch.equal(first, second)


def test_dropout_stays_with_disable_dropout_false(gpt2_with_dropout):
    from learners.models import load_causal_lm

    model = load_causal_lm(LearnerConfig(disable_dropout=False), ModelConfig(path=gpt2_with_dropout))
    assert {m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)} == {0.1}
    first, second = _two_train_passes(model)
    assert (first - second).abs().max() > 1e-3


def test_attention_dropout_read_from_the_config_is_off_under_varlen_in_train_mode(tmp_path):
    """Llama applies attention_dropout in its forward, with no Dropout module; varlen refuses any dropout."""
    from learners.models import load_causal_lm

    AutoModelForCausalLM.from_pretrained(MODEL, attention_dropout=0.1).save_pretrained(tmp_path)
    learner = LearnerConfig(attn_implementation="varlen")
    first, second = _two_train_passes(load_causal_lm(learner, ModelConfig(path=str(tmp_path))))
    assert torch.equal(first, second)
    learner.disable_dropout = False
    with pytest.raises(ValueError, match="varlen has no dropout"):
        _two_train_passes(load_causal_lm(learner, ModelConfig(path=str(tmp_path))))


def test_zero_dropout_zeroes_float_probabilities_in_sub_configs_and_leaves_flags():
    from transformers import LlamaConfig, PretrainedConfig

    from learners.models import zero_dropout

    outer = PretrainedConfig(
        hidden_dropout_prob=0.1, classifier_dropout=None, use_dropout=True, resid_pdrop=0.2, layerdrop=0.3
    )
    outer.text_config = LlamaConfig(attention_dropout=0.1)
    assert sorted(zero_dropout(outer)) == ["hidden_dropout_prob", "resid_pdrop", "text_config.attention_dropout"]
    assert outer.hidden_dropout_prob == outer.resid_pdrop == outer.text_config.attention_dropout == 0.0
    assert outer.use_dropout is True and outer.classifier_dropout is None and outer.layerdrop == 0.3


@pytest.fixture(scope="module")
def lora_engine():
    """A LoRA learner under ZeRO-3: the base partitioned and frozen, the adapter partitioned and trained."""
    from asyncrl.config import LoraConfig
    from learners.engine import build_engine, init_distributed

    init_distributed()
    config = LearnerConfig(lr=1e-2, zero_stage=3, lora=LoraConfig(rank=4, alpha=8.0))
    return build_engine(config, ModelConfig(path=MODEL), logprob_chunk_tokens=5)


def test_a_lora_learner_under_zero3_trains_its_adapter_alone_and_publishes_only_it(lora_engine):
    from asyncrl.weights.adapters import published
    from learners.engine import gathered_parameters

    engine, peft_model = lora_engine
    base = AutoModelForCausalLM.from_pretrained(MODEL)
    ids = torch.randint(3, 14, (3, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        lp, _ = engine(ids, torch.ones_like(ids), torch.roll(ids, -1, 1))
    assert (lp - _reference_logprobs(base, ids)).abs().max() < 1e-5, "a fresh adapter: the base's log-probs"
    assert all(hasattr(p, "ds_id") for p in peft_model.parameters()), "base and adapter both partitioned"
    start = {name: tensor.clone() for name, tensor in gathered_parameters(peft_model)}
    for _ in range(2):
        lp, _ = engine(ids, torch.ones_like(ids), torch.roll(ids, -1, 1))
        engine.backward(-lp.sum() / ids.numel())
        engine.step()
    after = dict(gathered_parameters(peft_model))
    moved = {name for name in start if not torch.equal(start[name], after[name])}
    assert moved and all("lora_" in name for name in moved), sorted(moved)[:3]
    assert any("lora_A" in name for name in moved) and any("lora_B" in name for name in moved)
    names = [name for name, _ in gathered_parameters(published(peft_model))]
    assert names and all("lora_" in name and ".default." not in name for name in names), names[:3]
    with torch.no_grad():
        trained, _ = engine(ids, torch.ones_like(ids), torch.roll(ids, -1, 1))
    assert (trained - _reference_logprobs(base, ids)).abs().max() > 1e-3, "the adapter moved the policy"


def test_a_lora_learner_packs_rows_as_it_pads_them(lora_engine):
    from conftest import make_rollout

    from learners.packing import pack

    engine, _ = lora_engine
    rollouts = [make_rollout(i, versions=[0] * n) for i, n in enumerate([3, 7, 1, 5])]
    results = []
    for packed in (False, True):
        ids, attention, positions, targets, _, mask, _, _ = pack(rollouts, packed, torch.arange(4.0))[:8]
        with torch.no_grad():
            lp, _ = engine(ids, attention, targets, 1.0, positions)
        results.append(lp[mask.bool()])
    assert results[0].numel() == 16 and (results[0] - results[1]).abs().max() < 1e-5


def test_a_lora_critic_trains_its_adapter_and_value_head_on_a_frozen_decoder(tmp_path):
    from asyncrl.config import AlgoConfig, LoraConfig
    from learners.critic import build_critic, value_loss
    from learners.engine import init_distributed

    init_distributed()
    torch.manual_seed(0)  # the adapter's A matrices start random
    config = LearnerConfig(zero_stage=3, lora=LoraConfig(rank=4, alpha=8.0))
    critic = build_critic(config, ModelConfig(path=MODEL), AlgoConfig(critic_lr=1e-2))
    trained = {name for name, p in critic.module.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in name or name.startswith("value_head") for name in trained), sorted(trained)
    assert any(name.startswith("value_head") for name in trained) and any("lora_" in name for name in trained)
    ids, attention = torch.tensor([[1, 5, 6, 7, 2]]), torch.ones(1, 5, dtype=torch.long)
    target = torch.full((1, 5), 0.5)
    for _ in range(10):
        loss = value_loss(critic(ids, attention), torch.zeros(1, 5), target, torch.ones(1, 5), None, 5)
        critic.backward(loss)
        critic.step()
    with torch.no_grad():
        values = critic(ids, attention)
    assert (values - 0.5).abs().max() < 0.3, values  # from 0: the values moved towards the returns


@pytest.mark.parametrize("dtype, stage", [("float32", None), ("bfloat16", None), ("bfloat16", 0)])
def test_the_first_update_is_adamws_first_whatever_the_precision(dtype, stage):
    """Adam's first step moves each weight by lr (times the sign of its gradient). DeepSpeed's 16-bit optimizers
    create their state with a step of zero gradients, which left the step count at 1 and made the first update
    0.74 lr; the learner starts the count at 0, so bf16 and fp32 learners take the same first steps, with one
    bf16 rank's default (DeepSpeed's bf16 optimizer, ZeRO stage 1) and without ZeRO alike."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    from learners.engine import build_engine, init_distributed
    from learners.masters import master_weight

    init_distributed()
    lr = 1e-3
    config = LearnerConfig(lr=lr, zero_stage=stage)
    engine, model = build_engine(config, ModelConfig(path=MODEL, dtype=dtype), logprob_chunk_tokens=5)
    params = dict(model.named_parameters())
    assert isinstance(engine.optimizer, BF16_Optimizer) == (dtype == "bfloat16" and stage is None)
    assert (master_weight(engine, next(iter(params.values()))) is not None) == (dtype == "bfloat16")

    def weight(p: torch.nn.Parameter) -> torch.Tensor:  # the fp32 value the optimizer updates
        return master_weight(engine, p) if dtype == "bfloat16" else p.detach().clone()

    before = {name: weight(p) for name, p in params.items()}
    ids = torch.randint(3, 14, (4, 8), generator=torch.Generator().manual_seed(5))
    lp, _ = engine(ids, torch.ones_like(ids), torch.roll(ids, -1, 1))
    engine.backward(-lp.float().sum() / ids.numel(), scale_wrt_gas=False)
    engine.step()
    moved = torch.cat([(weight(p) - before[name]).abs().flatten() for name, p in params.items()])
    moved = moved[moved > 0.1 * lr]  # weights with a gradient (the embedding rows of unseen tokens have none)
    assert moved.numel() > 1000
    assert moved.median().item() == pytest.approx(lr, rel=0.01)


def test_one_bf16_rank_builds_its_reference_without_an_optimizer():
    """The policy's stage 1 partitions optimizer state, which a frozen reference has none of: it is built at
    stage 0 and scores a batch."""
    from learners.engine import build_reference, init_distributed

    init_distributed()
    reference = build_reference(LearnerConfig(), ModelConfig(path=MODEL, dtype="bfloat16"), logprob_chunk_tokens=5)
    assert reference.zero_optimization_stage() == 0
    ids = torch.randint(3, 14, (2, 6), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        logprobs, _ = reference(ids, torch.ones_like(ids), torch.roll(ids, -1, 1))
    assert logprobs.shape == ids.shape and bool((logprobs < 0).all())


@pytest.mark.parametrize("stage", [None, 0, 3])
def test_a_bf16_checkpoint_exports_and_tells_how_it_was_written(tmp_path, stage):
    """ZeRO-3 writes bf16_zero_* shards that zero_to_fp32 reassembles into the fp32 master weights; DeepSpeed's
    bf16 optimizer (one bf16 rank's default) writes files of the same names in its own format, and no ZeRO
    none: those two export the module's bf16 weights. A checkpoint without ZeRO is known, so that a resumed
    learner takes the optimizer that wrote it."""
    from learners import checkpoint
    from learners.engine import build_engine, init_distributed
    from learners.masters import master_weight

    init_distributed()
    engine, model = build_engine(
        LearnerConfig(lr=1e-3, zero_stage=stage), ModelConfig(path=MODEL, dtype="bfloat16"), logprob_chunk_tokens=5
    )
    ids = torch.randint(3, 14, (4, 8), generator=torch.Generator().manual_seed(7))
    lp, _ = engine(ids, torch.ones_like(ids), torch.roll(ids, -1, 1))
    engine.backward(-lp.float().sum() / ids.numel(), scale_wrt_gas=False)
    engine.step()
    checkpoint.save(engine, tmp_path / "checkpoints", 1, None, 0, keep=2)
    folder = tmp_path / "checkpoints" / checkpoint.latest(tmp_path / "checkpoints")
    assert checkpoint.zero_sharded(folder) == (stage == 3)
    assert checkpoint.written_without_zero(tmp_path / "checkpoints") == (stage == 0)
    out = checkpoint.export_hf(tmp_path / "checkpoints", None, MODEL, tmp_path / "export", "float32")
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    for name, param in model.named_parameters():
        if stage == 3:  # the fp32 master weights themselves
            expected = master_weight(engine, param).cpu().view(exported[name].shape)
        else:
            expected = param.detach().float()
        assert torch.equal(exported[name], expected), name
