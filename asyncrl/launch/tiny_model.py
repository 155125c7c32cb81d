"""Build the tiny Llama-style policy and its character tokenizer from a config.

The quickstart needs no model hub: ``python -m asyncrl.launch.tiny_model DIR`` writes
an HF-format folder (``config.json``, ``model.safetensors``, tokenizer files)
that ``transformers.AutoModelForCausalLM.from_pretrained`` and vLLM load. The
weights are random but deterministic in ``seed``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>"]
CHARACTERS = list("0123456789=")


def build_tokenizer():  # -> transformers.PreTrainedTokenizerFast
    """A character-level tokenizer built with the ``tokenizers`` library."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=" "))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")


# The agent variant (``--agent``): ChatML's frame, the role names and the hint tool's whole call as single
# tokens, so that a model of 2 layers finds the call by chance in its first steps (asyncrl.envs.hint).
AGENT_SPECIAL = ["<pad>", "<bos>", "<|im_end|>", "<|im_start|>"]
AGENT_WORDS = ["system", "user", "assistant", "tool", '<tool_call>\n{"name": "hint", "arguments": {}}\n</tool_call>']
AGENT_CHARACTERS = list("0123456789=?\n")
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_agent_tokenizer():  # -> transformers.PreTrainedTokenizerFast
    """The character tokenizer with a ChatML template, its frame and the hint tool's call as whole tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(AGENT_SPECIAL + AGENT_WORDS + AGENT_CHARACTERS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in AGENT_SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in AGENT_WORDS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<|im_end|>", pad_token="<pad>"
    )
    tokenizer.chat_template = CHATML
    return tokenizer


def build(
    out_dir: str | Path,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    seed: int = 0,
    agent: bool = False,
    tied: bool = False,
) -> Path:
    """Write a random-init Llama-style model and its tokenizer to ``out_dir``.

    Two heads of 32: vLLM's CPU attention has kernels for head sizes from 32 up.
    ``tied``: the output head is the input embedding (``tie_word_embeddings``, as SmolLM2 and Qwen's small models).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_agent_tokenizer() if agent else build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 4,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=tied,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    if agent:  # a tool call ends the turn, as a stop string would: the tool's answer comes next
        call = tokenizer.convert_tokens_to_ids(AGENT_WORDS[-1])
        model.generation_config.eos_token_id = [tokenizer.eos_token_id, call]
    out = Path(out_dir)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--num-heads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--agent", action="store_true", help="the tokenizer of the tool-use quickstart (hint)")
    args = parser.parse_args()
    print(build(args.out_dir, args.hidden_size, args.num_layers, args.num_heads, args.seed, args.agent))


if __name__ == "__main__":
    main()
