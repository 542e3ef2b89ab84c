"""`prorsa local --model DIR`: what a model directory must hold, checked before minutes of
engine start-up, each problem named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from prorsa.cli import app
from prorsa.local.model import GIB, ModelError, check_model_dir

CONFIG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 256,
          "num_hidden_layers": 4, "num_attention_heads": 4,
          "max_position_embeddings": 2048}  # fmt: skip


def model_dir(tmp_path: Path, config: dict | None = None, weights: int = 1000,  # type: ignore[type-arg]
              tokenizer: bool = True) -> Path:  # fmt: skip
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(CONFIG if config is None else config))
    if weights:
        (d / "model.safetensors").write_bytes(b"\0" * weights)
    if tokenizer:
        (d / "tokenizer.json").write_text("{}")
    return d


def test_a_complete_directory_is_accepted_with_its_limits(tmp_path: Path) -> None:
    m = check_model_dir(model_dir(tmp_path), workers=2, kv_cache_gib=1, available_bytes=8 * GIB)
    assert (m.weight_bytes, m.vocab_size, m.max_positions) == (1000, 32000, 2048)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p / "nowhere", "no such directory"),
        (lambda p: (p / "f").write_text("x") and p / "f", "a file, not a model directory"),
        (lambda p: (p / "e").mkdir() or p / "e", "no config.json"),
        (lambda p: model_dir(p, config={"vocab_size": 5}), "names no architectures"),
        (lambda p: model_dir(p, weights=0), "no weights"),
        (lambda p: model_dir(p, tokenizer=False), "no tokenizer"),
        (lambda p: model_dir(p, config={**CONFIG, "vocab_size": 100}), "vocabulary of 100"),
        (lambda p: model_dir(p, config={"architectures": ["X"], "vocab_size": 32000}),
         "lacks num_hidden_layers, num_attention_heads, hidden_size"),
    ],
)  # fmt: skip
def test_each_problem_is_named(tmp_path: Path, make, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ModelError, match=message):
        check_model_dir(make(tmp_path), workers=1, kv_cache_gib=1, available_bytes=64 * GIB)


def test_a_model_too_large_for_the_cpu_memory_is_refused_with_the_figures(tmp_path: Path) -> None:
    d = model_dir(tmp_path, weights=3 * 1024**2)
    with pytest.raises(ModelError, match=r"2 workers x \(0.0 GiB of weights \+ 1 GiB of KV"):
        check_model_dir(d, workers=2, kv_cache_gib=1, available_bytes=GIB)
    check_model_dir(d, workers=1, kv_cache_gib=1, available_bytes=2 * GIB)


def test_prorsa_local_refuses_a_bad_model_before_starting_anything(tmp_path: Path) -> None:
    out = CliRunner().invoke(app, ["local", "--model", str(tmp_path / "missing"),
                                   "--workdir", str(tmp_path / "w")])  # fmt: skip
    assert out.exit_code == 2 and "no such directory" in " ".join(out.output.split())
    assert not (tmp_path / "w").exists()
