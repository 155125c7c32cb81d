"""The fast backend: vLLM's engine with continuous batching and in-place weight reloads.

Design choices, and why:

* The engine runs **in this process** (``VLLM_ENABLE_V1_MULTIPROCESSING=0``). The
  engine then steps only when :meth:`VllmBackend.generate` asks it to, so an
  update applied between two yields lands exactly between two engine steps:
  every token is stamped with the version that produced it (vLLM's own
  per-token version labels, where the installed vLLM has them), and a failed
  load can be rolled back before any request sees it. On a small CPU box a
  separate engine process buys little; the worker uses all cores either way.
* Requests go through the engine's ``add_request``/``step`` rather than
  ``LLM.generate``: all requests are in flight at once and each group is
  yielded as soon as its ``n`` samples are done, so the caller can ship
  rollouts and apply weight updates while the rest are still sampled.
* The engine detokenizes only for stop strings, which need it token by
  token; otherwise each sample is decoded once when its group is done. On a
  tiny model on CPU, where the engine loop's own work dominates, that made
  the generator 1.16x as fast (``bench/detokenize_bench.py``).
* Behaviour log-probs use ``logprobs_mode="processed_logprobs"``: the
  log-softmax of the logits after temperature, i.e. ``log_softmax(logits / T)``
  of the sampled token, as the transformers backend computes. (vLLM's default,
  ``raw_logprobs``, ignores temperature.) These are the learner's numbers only
  over the whole vocabulary: with ``top_p < 1`` vLLM's would be those of the
  renormalised nucleus, so the run config refuses it.
* ``load_folder`` uses the worker's ``reload_weights`` (vLLM's in-place
  reload, which re-runs the CPU weight packing). vLLM only warns on missing
  tensors and a failure half-way leaves a half-loaded model, so the folder is
  checked first (names and shapes against the starting checkpoint, file size
  against the safetensors header) and hard-linked into a private folder that
  the learner's pruning cannot delete mid-load (:mod:`generators.staging`).
  Should the engine still fail, the previous version is reloaded from its
  private copy before raising.
* ``load_shared`` (one machine, ``learner.shared_weights``) and
  ``receive_push`` hand tensors to the workers through a worker extension
  (:mod:`generators.vllm_push`), which copies them into the live model.
* With ``learner.lora``, the engine serves the base with one adapter slot;
  each version is a PEFT adapter folder swapped into that slot in place
  (:mod:`generators.vllm_adapters`), the base never reloaded.

Beyond vLLM's public API (``LLM``, ``SamplingParams``, ``TokensPrompt``,
``collective_rpc``, worker extensions), everything goes through
:mod:`generators.vllm_compat`, which checks the installed vLLM at import.
"""

from __future__ import annotations

import itertools
import json
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from asyncrl.config import read_secret
from asyncrl.weights import folders
from asyncrl.weights.push import push_world_size
from asyncrl.wire.protocol import SharedHandle
from generators import vllm_adapters, vllm_compat, vllm_push
from generators.base import GenerationRequest, PromptRefused, Sample, SamplingParams, generate_stepwise, within
from generators.staging import checkpoint_spec, model_spec, stage, sweep_stages

if TYPE_CHECKING:
    from asyncrl.config import LoraConfig

# Before vLLM builds its first engine in this process (see module doc).
vllm_compat.run_engine_in_this_process()


def _check_head_size(model_path: str | Path) -> None:
    """Fail fast, before the slow engine start, on a head size vLLM's CPU attention lacks."""
    supported = vllm_compat.cpu_attention_head_sizes()
    if supported is None:  # not on the CPU
        return
    config = json.loads((Path(model_path) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if head_dim not in supported:
        raise ValueError(
            f"{model_path}: head_dim={head_dim} is not supported by vLLM's CPU attention "
            f"(supported: {supported}); use the transformers backend or a model with a supported head size"
        )


def kv_cache_bytes(requested: int | None) -> int | None:
    """The KV cache size to ask vLLM for: ``requested``, or when None 1 GiB on a CPU (vLLM cannot profile
    free memory there) and None on a GPU, where vLLM sizes the cache from ``gpu_memory_utilization``."""
    import torch

    if requested is None and not torch.cuda.is_available():
        return 1 << 30
    return requested


class VllmBackend:
    """Samples with vLLM and returns behaviour log-probs and the weight version of every token."""

    updates_mid_batch = True

    def __init__(
        self,
        model_path: str,
        dtype: str = "float32",
        enforce_eager: bool = True,
        seed: int = 0,
        kv_cache_memory_bytes: int | None = None,
        max_model_len: int | None = None,
        stage_dir: str | None = None,
        push: Any = None,
        push_rank: int = 1,
        lora: LoraConfig | None = None,
        **engine_kwargs: Any,
    ) -> None:
        """Start the engine on ``model_path`` (an HF folder) as version 0.

        ``kv_cache_memory_bytes`` sizes the KV cache explicitly; None: vLLM
        sizes it from ``gpu_memory_utilization`` on a GPU, and it is 1 GiB on
        a CPU, where vLLM cannot profile free memory; ``stage_dir`` is
        where private copies of loaded versions live when hard links into the
        learner's folder are not possible (default: the system temp dir).
        ``engine_kwargs`` go to ``vllm.LLM`` (e.g. ``max_num_seqs``). ``push``
        (:class:`asyncrl.config.PushConfig`) and ``push_rank`` place the engine
        in the learner's weight push group, for ``push:`` updates. With ``lora``
        (``learner.lora`` on), the engine serves the base with one adapter,
        all zero at version 0, and each version loads as a PEFT adapter folder.
        """
        _check_head_size(model_path)
        from transformers import AutoTokenizer
        from vllm import LLM

        self.model_path = str(model_path)
        # With prefix caching, every request's cache key is salted with the weights it starts on
        # (a count of loads): KV computed under old weights never serves a new request, and an update
        # flushes nothing (running requests keep their KV, as they do without the cache).
        engine_kwargs.setdefault("enable_prefix_caching", False)
        kv_cache_memory_bytes = kv_cache_bytes(kv_cache_memory_bytes)
        if kv_cache_memory_bytes is not None:
            engine_kwargs["kv_cache_memory_bytes"] = kv_cache_memory_bytes
        self._prefix_caching = bool(engine_kwargs["enable_prefix_caching"])
        if lora is not None and lora.enabled:
            engine_kwargs.update(vllm_adapters.engine_args(lora))
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(model_path)
            self.eos_id = self.tokenizer.eos_token_id
        except (OSError, ValueError):  # a folder with weights (or a config) only: token ids in and out
            self.tokenizer = None
            self.eos_id = json.loads((Path(model_path) / "config.json").read_text()).get("eos_token_id")
            engine_kwargs["skip_tokenizer_init"] = True
        self._spec = model_spec(model_path)
        tied = bool(json.loads((Path(model_path) / "config.json").read_text()).get("tie_word_embeddings"))
        self._optional = ["lm_head.weight"] if tied else []  # a tied head may come with the weights, or not
        self.llm = LLM(
            model=self.model_path,
            dtype=dtype,
            enforce_eager=enforce_eager,
            seed=seed,
            max_model_len=max_model_len,
            logprobs_mode="processed_logprobs",
            worker_extension_cls="generators.vllm_push.WeightPushExtension",
            **engine_kwargs,
        )
        self._push, self._push_rank, self._push_joined = push, push_rank, False
        self._push_ranks = int(engine_kwargs.get("tensor_parallel_size") or 1)  # one per worker
        self.version = 0
        self._engine_stamps = vllm_compat.labels_weight_versions()  # per-token versions from the engine
        self._async_scheduling, self._label_after_step = vllm_compat.async_scheduling(self.llm), None  # see relabel
        # Counts weight changes: the prefix cache's salt. Not the version: a learner resumed from a checkpoint
        # publishes its version numbers again, with other weights.
        self._weights_loaded = 0
        self._label(0)
        self._good_folder = self.model_path  # what to reload if a load fails half-way
        self._good_version = 0  # the version that folder holds
        self._staged: Path | None = None
        self._stage_dir = stage_dir
        sweep_stages(Path(stage_dir or tempfile.gettempdir()))  # the learner's folder is swept at the first load
        self._adapter = None  # with learner.lora, the engine's adapter slot every prompt goes with
        if lora is not None and lora.enabled:
            self._adapter = vllm_adapters.AdapterSlot(self.llm, lora, self.model_path, stage_dir)
            self._wire = vllm_adapters.AdapterWire(push, push_rank, vllm_adapters.engine_device())
        self._ids = itertools.count()
        self.ignore_eos = False  # benchmarks only: sample max_new_tokens whatever the model says

    # ------------------------------------------------------------------ sampling
    def generate(
        self,
        requests: Sequence[GenerationRequest],
        params: SamplingParams,
        between_steps: Callable[[], None] | None = None,
    ) -> Iterator[tuple[GenerationRequest, list[Sample]]]:
        """Put every request in flight and yield each group as soon as its ``n`` samples finish;
        ``between_steps`` runs after every engine step, where an update may land."""
        return generate_stepwise(self, requests, params, between_steps)

    def sampling(self, params: SamplingParams) -> Any:
        """vLLM's sampling parameters for ``params``: behaviour log-probs of the sampled tokens, one output per
        request once all its samples are done."""
        from vllm import SamplingParams as VllmSamplingParams

        return VllmSamplingParams(
            n=params.n,
            max_tokens=params.max_new_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=0,
            stop=list(params.stop) or None,
            include_stop_str_in_output=True,  # as the transformers backend: the text ends with the stop string
            ignore_eos=self.ignore_eos,
            logprobs=0,  # the sampled token's log-prob only
            output_kind=vllm_compat.final_only_output_kind(),  # one output per group, all n samples
            # Stop strings need vLLM's incremental detokenizer; otherwise each sample is decoded once
            # when its group is done, which spares the engine loop per-token work (and the text of
            # every logprob's token).
            detokenize=bool(params.stop),
        )

    def add(self, prompt_ids: Sequence[int], sampling: Any, adapter: Any = None, salt: str | None = None) -> str:
        """Put one request in flight; its engine id. A prompt the engine refuses raises :class:`PromptRefused`.
        ``adapter`` and ``salt`` (a pool's run): the adapter the request goes with and what salts its prefix
        cache keys; by default the backend's own adapter and weights."""
        from vllm.inputs import TokensPrompt

        request_id = f"asyncrl-{next(self._ids)}"
        prompt = TokensPrompt(prompt_token_ids=list(prompt_ids))
        if self._prefix_caching:
            prompt["cache_salt"] = f"asyncrl-w{self._weights_loaded}" if salt is None else salt
        if adapter is None and self._adapter is not None:
            adapter = self._adapter.request
        try:
            vllm_compat.add_request(self.llm, request_id, prompt, sampling, adapter)
        except Exception as exc:
            if vllm_compat.refuses_prompt(exc):  # this prompt; another error is every request's
                raise PromptRefused(str(exc)) from exc
            raise
        return request_id

    def step(self) -> list[Any]:
        """One engine step: the outputs of the requests it finished (with per-sample :meth:`sample`)."""
        outputs = vllm_compat.step(self.llm)
        if self._label_after_step is not None:  # the batch computed before the change is in: label anew
            vllm_compat.set_weight_version(self.llm, self._label_after_step)
            self._label_after_step = None
        return [output for output in outputs if output.finished]

    def abort(self, request_ids: list[str]) -> None:
        vllm_compat.abort_requests(self.llm, request_ids)

    def _label(self, version: int) -> None:
        """New weights in the engine: stamp ``version`` on the tokens to come, and salt new prefixes anew."""
        self._weights_loaded += 1
        self.relabel(version)

    def relabel(self, label: int) -> None:
        """Label the tokens sampled from now on with ``label`` (where the engine labels tokens at all). Under async
        scheduling (vLLM's on a GPU) a batch is labelled as the next step collects it: the one in flight keeps the
        old label."""
        self._label_now = label
        if self._engine_stamps and self._async_scheduling:
            self._label_after_step = label
        elif self._engine_stamps:
            vllm_compat.set_weight_version(self.llm, label)

    def sample(self, completion: Any, started_version: int, version_of: Callable[[int], int] | None = None) -> Sample:
        """One finished sample; ``version_of`` maps the engine's token labels to versions (a pool's run's)."""
        tokens = list(completion.token_ids)
        logprobs = [position[token].logprob for position, token in zip(completion.logprobs, tokens)]
        # Without the engine's labels, a request spanning an update has its start's version: never too young.
        version_of = version_of or int
        versions = [version_of(self._label_now) if self._engine_stamps else started_version] * len(tokens)
        for start, end, label in vllm_compat.weight_version_spans(completion):
            versions[start:end] = [version_of(label)] * (end - start)
        reason = "length" if completion.finish_reason == "length" else "stop"
        text = completion.text
        if not text and tokens and self.tokenizer is not None:  # not detokenized by the engine (see generate)
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return Sample(tokens, logprobs, versions, reason, text)

    # ------------------------------------------------------------------ weights
    def load_folder(self, folder: Path, version: int, timeout_s: float) -> None:
        """Switch to the HF folder of ``version`` entirely, or raise and keep serving the current version."""
        if self._adapter is not None:
            self._adapter.load(folder, version, timeout_s, self.stage)
            self._label(version)
            self.version = version
            return
        # Checking and staging change nothing in the engine.
        staged = within(
            timeout_s,
            f"checking and staging weights v{version} (generator.weight_load_timeout_s)",
            self._check_and_stage,
            folder,
            version,
        )
        try:
            self.llm.collective_rpc(vllm_compat.reload_weights_from_folder, args=(str(staged),))
        except Exception as error:
            self._rollback(version, error)
            shutil.rmtree(staged, ignore_errors=True)
            raise RuntimeError(f"weights v{version}: engine failed to load them: {error}") from error
        self._label(version)
        self.version = version
        if self._staged is not None:
            shutil.rmtree(self._staged, ignore_errors=True)
        self._staged, self._good_folder, self._good_version = staged, str(staged), version

    def receive_push(self, epoch: int, version: int, timeout_s: float) -> None:
        """Receive ``version`` from push ``epoch`` straight into the workers (``push.timeout_s`` bounds each wait)."""
        if self._adapter is not None:
            self._swap_received(*self._wire.pushed(epoch, version))
            return
        if self._push is None or self._push.address is None:
            raise ValueError(f"weights v{version} are pushed but push.address is not set")
        if not self._push_joined:
            world = push_world_size(self._push, self._push_ranks)
            self.llm.collective_rpc(
                "push_join",
                args=(
                    self._push.address,
                    self._push_rank,
                    world,
                    self._push.timeout_s,
                    read_secret(self._push),
                    self._spec,
                    self._optional,
                ),
            )
            self._push_joined = True
        self._load_in_workers("push_receive", (epoch, version), version)

    def load_shared(self, handle: SharedHandle, version: int, timeout_s: float) -> None:
        """Copy ``version`` out of the learner's shared-memory segment straight into the workers."""
        if self._adapter is not None:
            self._swap_received(self._wire.shared(handle, version, timeout_s), version)
            return
        self._load_in_workers(
            "shared_receive", (msgspec.msgpack.encode(handle), version, timeout_s, self._spec, self._optional), version
        )

    def _swap_received(self, tensors: list, version: int) -> None:
        """An adapter version that came as tensors: checked, written in memory, swapped into the slot."""
        self._adapter.swap_in(self._adapter.stage_tensors(tensors, version), version)
        self._label(version)
        self.version = version

    def _load_in_workers(self, method: str, args: tuple, version: int) -> None:
        """Run a worker extension's receive-and-load ``method`` on every worker; where that leaves the weights
        in doubt (:func:`generators.vllm_push.loaded_version`), go back to weights known to be whole."""
        try:
            received = vllm_push.loaded_version(self.llm.collective_rpc(method, args=args))
        except vllm_push.WeightsInDoubt as error:  # any other error: nothing was loaded, the current version serves
            self._rollback(version, error)
            self.version = self._good_version
            self._label(self.version)
            raise RuntimeError(
                f"weights v{version}: engine failed to load them; "
                f"serving v{self.version} from {self._good_folder}: {error}"
            ) from error
        self._label(received)
        self.version = received

    def _check_and_stage(self, folder: Path, version: int) -> Path:
        """Validate the announced folder against the starting checkpoint, then pin a private copy."""
        if not (folder / "model.safetensors").exists():
            raise FileNotFoundError(f"weights v{version}: {folder}/model.safetensors is missing")
        folders.check_shapes(self._spec, checkpoint_spec(folder), version, self._optional)
        return self.stage(folder, version)

    def _rollback(self, version: int, error: Exception) -> None:
        """Reload the last good version after a failed load; if even that fails, nothing is safe to serve."""
        try:
            self.llm.collective_rpc(vllm_compat.undo_partial_reload)
            self.llm.collective_rpc(vllm_compat.reload_weights_from_folder, args=(self._good_folder,))
        except Exception as second:
            raise RuntimeError(
                f"weights v{version} failed ({error}) and restoring v{self.version} failed too ({second}); "
                "the engine must be restarted"
            ) from second

    def stage(self, folder: Path, version: int) -> Path:
        """A private copy of ``folder`` for the engine to load from (hard links where the file system allows)."""
        return stage(folder, version, self._stage_dir, keep=self._staged)

    def close(self) -> None:
        """Free the engine and the private copies."""
        if self._adapter is not None:
            self._adapter.close()
        if self._staged is not None:
            shutil.rmtree(self._staged.parent, ignore_errors=True)
            self._staged = None
        engine = getattr(self, "llm", None)
        if engine is not None:
            del self.llm
            import gc

            gc.collect()
            vllm_compat.release_distributed()
