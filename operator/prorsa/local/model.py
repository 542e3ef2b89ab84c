"""A tiny random-weight Llama with a byte-level BPE tokenizer, generated in-process.

Nothing can be downloaded here, and nothing needs to be: random weights give gibberish, but
greedy decoding is deterministic, so the same prompt must give the same tokens whether it is
served on one worker or prefilled on one and decoded on another after a KV transfer. That makes
this model an exact end-to-end check of disaggregation (DESIGN.md, measured facts).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
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
        show_progress=False,  # its bars print blank lines on a terminal-less run
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
    from transformers.utils import logging as hf_logging

    # a shard progress bar for a 2 MB model is only noise
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    model.save_pretrained(path)
    (path / MARKER).write_text(json.dumps({"seed": seed, "vocab_size": vocab_size}) + "\n")
    return path


# ---- a model of the user's own (`prorsa local --model DIR`) -----------------------------------

GIB = 1024**3
MIN_VOCAB = 400  # the driver sends token ids below this (any real tokenizer has them)


class ModelError(ValueError):
    """A model directory `prorsa local` cannot serve, with what is wrong."""


@dataclass(frozen=True)
class ModelDir:
    path: Path
    weight_bytes: int
    vocab_size: int
    max_positions: int


def _mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_model_dir(
    path: Path, workers: int, kv_cache_gib: int, available_bytes: int | None = None
) -> ModelDir:
    """What vLLM on the CPU needs of a Hugging Face-format model directory, checked before
    minutes of start-up: a config naming an architecture, weights, a tokenizer, a vocabulary
    the driver's token ids fit, and room in memory for every worker's copy and KV cache."""
    where = f"--model {path}"
    if not path.exists():
        raise ModelError(f"{where}: no such directory")
    if not path.is_dir():
        raise ModelError(f"{where}: a file, not a model directory")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelError(f"{where}: not a Hugging Face model directory (no config.json)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelError(f"{where}: config.json is not readable JSON ({e})") from None
    if not isinstance(cfg, dict) or not cfg.get("architectures"):
        raise ModelError(f"{where}: config.json names no architectures (is it a model?)")
    weights = [*path.glob("*.safetensors"), *path.glob("pytorch_model*.bin")]
    if not weights:
        raise ModelError(f"{where}: no weights (*.safetensors or pytorch_model*.bin)")
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model",
                                              "tokenizer_config.json")):  # fmt: skip
        raise ModelError(f"{where}: no tokenizer (tokenizer.json, tokenizer.model or "
                         "tokenizer_config.json)")  # fmt: skip
    nested = cfg.get("text_config")
    text: dict[str, Any] = nested if isinstance(nested, dict) else cfg
    missing = [k for k in ("num_hidden_layers", "num_attention_heads", "hidden_size")
               if not isinstance(text.get(k), int)]  # fmt: skip
    if missing:
        raise ModelError(f"{where}: config.json lacks {', '.join(missing)} (the KV size per "
                         "token is computed from them)")  # fmt: skip
    vocab = int(text.get("vocab_size") or 0)
    if vocab < MIN_VOCAB:
        raise ModelError(f"{where}: a vocabulary of {vocab} tokens; the workload driver needs "
                         f"at least {MIN_VOCAB}")  # fmt: skip
    size = sum(w.stat().st_size for w in weights)
    avail = _mem_available() if available_bytes is None else available_bytes
    need = workers * (size + kv_cache_gib * GIB)
    if avail is not None and need > avail:
        raise ModelError(
            f"{where}: too large for this machine's memory: {workers} workers x "
            f"({size / GIB:.1f} GiB of weights + {kv_cache_gib} GiB of KV cache) = "
            f"{need / GIB:.1f} GiB, {avail / GIB:.1f} GiB available; use fewer --workers or "
            "a smaller model"
        )
    return ModelDir(path, size, vocab, int(text.get("max_position_embeddings") or 4096))
