"""Counting a turn's prompt tokens before any worker has seen it (for `turn_submit`).

Token-id prompts are exact. Text prompts are exact with the model's `tokenizer.json` (the fast
`tokenizers` library, no model code), else estimated at 4 bytes per token. Chat prompts are
estimated from their contents (the chat template is the worker's business); the worker's own
count arrives with `prefill_done`.
"""

from __future__ import annotations

import json
from pathlib import Path

from prorsa.router.requests import Turn

_CHAT_OVERHEAD_PER_MESSAGE = 4


class TokenCounter:
    def __init__(self, tokenizer_dir: Path | None = None) -> None:
        self._tok = None
        if tokenizer_dir is not None:
            from tokenizers import Tokenizer

            path = tokenizer_dir / "tokenizer.json"
            if not path.is_file():
                raise FileNotFoundError(f"no tokenizer.json in {tokenizer_dir}")
            self._tok = Tokenizer.from_file(str(path))

    @property
    def exact_text(self) -> bool:
        return self._tok is not None

    def text(self, s: str) -> int:
        if self._tok is not None:
            return len(self._tok.encode(s, add_special_tokens=True).ids)
        return max(1, len(s.encode()) // 4)

    def count(self, turn: Turn) -> int:
        if turn.prompt_ids is not None:
            return len(turn.prompt_ids)
        if turn.prompt_text is not None:
            return self.text(turn.prompt_text)
        if turn.messages:
            total = 0
            for m in turn.messages:
                c = m.get("content")
                body = c if isinstance(c, str) else json.dumps(c) if c is not None else ""
                total += self.text(body) + _CHAT_OVERHEAD_PER_MESSAGE
            return total
        p = turn.body.get("prompt")  # batched: sum of the prompts
        if isinstance(p, list):
            return sum(len(x) if isinstance(x, list) else self.text(str(x)) for x in p)
        return 1
