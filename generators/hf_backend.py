"""The reference backend: batched sampling with ``transformers.generate``.

Slow next to vLLM but dependable and exact, so it is the fallback where vLLM
is not installed and the reference the vLLM backend is tested against. The
whole batch runs on one version of the weights: an update requested while a
batch is sampled applies before the next batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)

from asyncrl.weights import adapters, folders
from asyncrl.weights.push import WeightGroup, open_group
from asyncrl.weights.shared import ViewCache
from asyncrl.wire.protocol import SharedHandle
from generators.base import GenerationRequest, Sample, SamplingParams, within

if TYPE_CHECKING:
    from asyncrl.config import LoraConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def end_tokens(generation_eos: int | list[int] | None, tokenizer_eos: int | None) -> list[int]:
    """The tokens that end a response: the model's generation config may name several (Gemma's
    ``<end_of_turn>``, Llama 3's ``<|eot_id|>``) besides the tokenizer's EOS, and vLLM stops at each of them."""
    listed = [generation_eos] if isinstance(generation_eos, int) else list(generation_eos or [])
    return list(dict.fromkeys([*listed, *([tokenizer_eos] if tokenizer_eos is not None else [])]))


class _TokenLogprobs(LogitsProcessor):
    """Each sampled token's ``log_softmax(logits / T)``, kept as the batch goes.

    Called before the temperature is applied (``generate`` applies a user's
    processors first), on the model's own logits: the backend's generation
    config sets nothing else. One step's full-vocabulary log-probs are held
    at a time, where ``output_logits`` would keep every step's in float32
    (64 rows x 1,024 tokens x 152k vocabulary: 40 GB).
    """

    def __init__(self, temperature: float) -> None:
        self.temperature = temperature
        self._step: torch.Tensor | None = None
        self.picked: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self._step = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def token_chosen(self, input_ids: torch.Tensor) -> None:
        assert self._step is not None
        self.picked.append(self._step.gather(-1, input_ids[:, -1:]).squeeze(-1))


class _EveryToken(StoppingCriteria):
    """Calls ``callback`` with the ids after every generated token and never stops generation."""

    def __init__(self, callback: Callable[[torch.Tensor], None]) -> None:
        self.callback = callback

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        self.callback(input_ids)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class TransformersBackend:
    """Samples with ``model.generate`` and returns behaviour log-probs per token.

    One batch, one version: a weight update waits for the next batch.
    """

    updates_mid_batch = False

    def __init__(
        self,
        model_path: str,
        dtype: str = "float32",
        device: str | None = None,
        push: Any = None,
        push_rank: int = 1,
        lora: LoraConfig | None = None,
    ) -> None:
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=_DTYPES[dtype]).to(self.device)
        # with learner.lora, the base and a fresh adapter (the base's outputs); each version is an adapter
        self.adapter = lora is not None and lora.enabled
        if self.adapter:
            self.model = adapters.with_adapter(self.model, lora)
        self.model.eval()
        self.version = 0
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.eos_ids = end_tokens(self.model.generation_config.eos_token_id, self.tokenizer.eos_token_id)
        # The folder's sampling defaults (Qwen2.5-Instruct ships repetition_penalty 1.05, top_k 20) would
        # change what is sampled away from the log-probs recorded and from what vLLM samples: none apply.
        self.model.generation_config = GenerationConfig(
            bos_token_id=self.model.generation_config.bos_token_id,
            eos_token_id=self.eos_ids or None,
            pad_token_id=self.pad_id,
        )
        self._push, self._push_rank = push, push_rank
        self._push_group: WeightGroup | None = None
        self._shared = ViewCache()

    @torch.no_grad()
    def generate(
        self,
        requests: Sequence[GenerationRequest],
        params: SamplingParams,
        between_steps: Callable[[], None] | None = None,  # called per token; never loads weights here
    ) -> Iterator[tuple[GenerationRequest, list[Sample]]]:
        if not requests:
            return
        version = self.version  # the whole batch is sampled with these weights
        width = max(len(r.prompt_ids) for r in requests)
        # Left padding keeps every prompt's last token in the same column.
        ids = torch.full((len(requests), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, request in enumerate(requests):
            ids[row, width - len(request.prompt_ids) :] = torch.tensor(request.prompt_ids)
            mask[row, width - len(request.prompt_ids) :] = 1
        greedy = params.temperature == 0  # evaluation's pass@1
        sampling = {} if greedy else {"temperature": params.temperature, "top_p": params.top_p, "top_k": 0}
        recorder = _TokenLogprobs(params.temperature or 1.0)

        def after_token(input_ids: torch.Tensor) -> None:
            recorder.token_chosen(input_ids)
            if between_steps is not None:
                between_steps()

        sequences = self.model.generate(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            do_sample=not greedy,
            num_return_sequences=params.n,
            max_new_tokens=params.max_new_tokens,
            **sampling,
            pad_token_id=self.pad_id,
            eos_token_id=self.eos_ids or None,
            logits_processor=LogitsProcessorList([recorder]),
            stopping_criteria=StoppingCriteriaList([_EveryToken(after_token)]),
        )
        tokens = sequences[:, width:].cpu()
        picked = torch.stack(recorder.picked, dim=1).cpu()
        for index, request in enumerate(requests):
            rows = range(index * params.n, (index + 1) * params.n)
            yield request, [self._sample(tokens[r].tolist(), picked[r].tolist(), params, version) for r in rows]

    def _sample(self, tokens: list[int], logprobs: list[float], params: SamplingParams, version: int) -> Sample:
        length, reason = len(tokens), "length"
        ends = [i for i, token in enumerate(tokens) if token in self.eos_ids]
        if ends:
            length, reason = ends[0] + 1, "stop"
        text = self.tokenizer.decode(tokens[:length], skip_special_tokens=True)
        for stop in params.stop:
            cut = text.find(stop)
            if cut >= 0:
                length, reason = _tokens_covering(self.tokenizer, tokens, cut + len(stop)), "stop"
                text = text[: cut + len(stop)]
        return Sample(tokens[:length], logprobs[:length], [version] * length, reason, text)

    def load_folder(self, folder: Path, version: int, timeout_s: float) -> None:
        """Read the whole version (within ``timeout_s``), then copy it in, all or nothing."""
        state = within(timeout_s, f"reading weights v{version}", folders.read_state_dict, folder, version)
        self._load(state, version)

    def _load(self, state: dict[str, torch.Tensor], version: int) -> None:
        """A whole model's weights, or an adapter's, all or nothing."""
        if self.adapter:
            adapters.load_adapter(self.model, state, version)
        else:
            folders.load_into(self.model, state, version)
        self.version = version

    def receive_push(self, epoch: int, version: int, timeout_s: float) -> None:
        """Receive ``version`` from push ``epoch`` over the process group (``push.timeout_s`` bounds each wait)."""
        if self._push is None or self._push.address is None:
            raise ValueError(f"weights v{version} are pushed but push.address is not set")
        if self._push_group is None:
            self._push_group = open_group(self._push, self._push_rank, self.device)
        manifest, tensors = self._push_group.receive(epoch, version)
        self._load(dict(tensors), manifest.version)

    def load_shared(self, handle: SharedHandle, version: int, timeout_s: float) -> None:
        """Copy ``version`` out of the learner's segment, then into the model, all or nothing."""
        tensors = self._shared.view(handle, self.device).read(version, timeout_s)
        self._load(dict(tensors), version)

    def close(self) -> None:
        pass


def _tokens_covering(tokenizer, tokens: list[int], num_chars: int) -> int:
    """The fewest leading tokens whose decoded text has ``num_chars`` characters."""
    for count in range(1, len(tokens) + 1):
        if len(tokenizer.decode(tokens[:count], skip_special_tokens=True)) >= num_chars:
            return count
    return len(tokens)
