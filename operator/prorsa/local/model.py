"""A tiny random-weight Llama with a byte-level BPE tokenizer, generated in-process.

Nothing can be downloaded here, and nothing needs to be: random weights give gibberish, but
greedy decoding is deterministic, so the same prompt must give the same tokens whether it is
served on one worker or prefilled on one and decoded on another after a KV transfer. That makes
this model an exact end-to-end check of disaggregation (DESIGN.md, measured facts).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CORPUS = [
    "The agent reads the repository, runs the tests and edits the failing function.",
    "A search agent issues a query, reads the results and writes a short answer.",
    "Prefill computes the prompt; decode produces one token at a time from the KV cache.",
    "Reinforcement learning rollouts interleave model turns with tool calls.",
    "def add(a, b):\n    return a + b\n\nassert add(2, 3) == 5\n",
    "0123456789 +-*/=()[]{}<>:;,.!?'\" abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ",
]
MARKER = "prorsa-tiny.json"


def is_tiny_model(path: Path) -> bool:
    return (path / MARKER).is_file() and (path / "config.json").is_file()


def make_tiny_model(path: Path, *, vocab_size: int = 512, seed: int = 0) -> Path:
    """Write the model to `path` (idempotent: an existing one is kept)."""
    if is_tiny_model(path):
        return path
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast: Any = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>"
    )
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant: {% endif %}"
    )
    fast.save_pretrained(path)

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        dtype="bfloat16",
    )
    model: Any = LlamaForCausalLM(config)  # type: ignore[no-untyped-call]
    model = model.to(torch.bfloat16)
    model.save_pretrained(path)
    (path / MARKER).write_text(json.dumps({"seed": seed, "vocab_size": vocab_size}) + "\n")
    return path
