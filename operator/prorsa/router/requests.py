"""An OpenAI request, validated into a `Turn`; bad input becomes an OpenAI-shaped 4xx.

The router only reads what placement and events need (model, prompt, stream, max tokens, the
trajectory id) and passes the body through unchanged otherwise, so every vLLM sampling option
keeps working.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

TRAJECTORY_HEADER = "X-Prorsa-Trajectory"
MAX_TRAJECTORY_ID = 256


class Kind(StrEnum):
    COMPLETIONS = "completions"
    CHAT = "chat"

    @property
    def path(self) -> str:
        return "/v1/completions" if self is Kind.COMPLETIONS else "/v1/chat/completions"


class ApiError(Exception):
    """An error the client must see, in the OpenAI error shape."""

    def __init__(
        self, status: int, message: str, param: str | None = None, type_: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.status,
            }
        }


@dataclass(slots=True)
class Turn:
    kind: Kind
    body: dict[str, Any]
    traj: str | None
    stream: bool
    prompt_text: str | None = None  # completions with a text prompt
    prompt_ids: list[int] | None = None  # completions with a token-id prompt
    messages: list[dict[str, Any]] = field(default_factory=list)  # chat
    batched: bool = False  # several prompts or n > 1: served on one worker, not split

    @property
    def can_split(self) -> bool:
        """Whether prefill and decode may run on different workers."""
        return not self.batched


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _check_optional(body: dict[str, Any]) -> None:
    for name in ("max_tokens", "max_completion_tokens", "n", "min_tokens"):
        v = body.get(name)
        if v is not None and (not _is_int(v) or v < (0 if name == "min_tokens" else 1)):
            raise ApiError(400, f"'{name}' must be a positive integer", name)
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        v = body.get(name)
        if v is not None and not _is_number(v):
            raise ApiError(400, f"'{name}' must be a number", name)
    if "stream" in body and not isinstance(body["stream"], bool):
        raise ApiError(400, "'stream' must be a boolean", "stream")
    if body.get("stream_options") is not None and not isinstance(body["stream_options"], dict):
        raise ApiError(400, "'stream_options' must be an object", "stream_options")
    if "user" in body and not isinstance(body["user"], str):
        raise ApiError(400, "'user' must be a string", "user")


def _trajectory(headers: Any, body: dict[str, Any]) -> str | None:
    traj = headers.get(TRAJECTORY_HEADER) or body.get("user") or None
    if traj is not None and len(traj) > MAX_TRAJECTORY_ID:
        raise ApiError(400, f"trajectory id longer than {MAX_TRAJECTORY_ID} characters", "user")
    return traj


def parse_turn(kind: Kind, raw: bytes, headers: Any) -> Turn:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' is required and must be a non-empty string", "model")
    _check_optional(body)
    turn = Turn(kind, body, _trajectory(headers, body), bool(body.get("stream", False)))
    turn.batched = (body.get("n") or 1) > 1
    if kind is Kind.COMPLETIONS:
        _parse_prompt(turn, body.get("prompt"))
    else:
        _parse_messages(turn, body.get("messages"))
    return turn


def _parse_prompt(turn: Turn, prompt: object) -> None:
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "'prompt' must not be empty", "prompt")
        turn.prompt_text = prompt
    elif isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt):
        turn.prompt_ids = prompt
    elif (
        isinstance(prompt, list)
        and prompt
        and all(
            (isinstance(p, str) and p)
            or (isinstance(p, list) and p and all(_is_int(t) and t >= 0 for t in p))
            for p in prompt
        )
    ):
        turn.batched = True
    else:
        raise ApiError(
            400,
            "'prompt' is required: a string, a list of token ids, or a list of either",
            "prompt",
        )


def _parse_messages(turn: Turn, messages: object) -> None:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' is required and must be a non-empty list", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a 'role'", "messages")
    turn.messages = messages
