"""The decode step a real engine runs under a rollout's load, beside its calibration.

The controller learns the decode step online from each engine's `/metrics` (the mean step
between tokens at the mean batch, `control/engine_metrics.decode_window`); the offline
calibration times one steady batch. On real workers the two differ (the e2e test of the local
runner prints by how much). This benchmark separates the candidate causes on one real vLLM
worker (the tiny model, the mixed role, no router): the same engine, calibrated, then loaded
the ways a rollout loads it, each window read the way the controller reads it:

- steady: 8 sequences of 33 tokens at once (the calibration's own batch);
- ramp and skewed: sequences of different lengths started together, so the batch shrinks as
  they end. The mean step between tokens weights each step by its batch; under the linear
  model it is the step at sum(b^2)/sum(b), not at the mean batch the controller pairs it
  with. The row prints the model at both batches (both are known here);
- open churn: 40 requests arriving at random (mean gap 0.12 s), random lengths;
- closed churn: 40 requests, a new one whenever one of 8 ends (a batch near 8 that turns over).

Each row: the engine's mean step, the mean batch, the controller's window figure (the local
prefill taken out at the calibrated prefill rate) and the calibrated model at that batch and
KV, with the excess. Asserts nothing; the order of the runs is repeated `--repeats` times.

    .venv/bin/python benchmarks/decode_step.py [--repeats 2] [--json F]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

from prorsa.control.engine_metrics import decode_window
from prorsa.local.calibrate import SHORT_KV, Calibration, _Timer, calibrate
from prorsa.local.model import make_tiny_model
from prorsa.local.redis_server import RedisServer
from prorsa.local.stack import SERVED_MODEL, LocalStack, StackConfig
from prorsa.policy.allocate import Role

PROMPT = 16  # tokens of each request's prompt


def _prompt(salt: int) -> list[int]:
    return [3 + (i * 7 + salt * 13) % 390 for i in range(PROMPT)]


def _token_weighted_batch(lengths: list[int]) -> float:
    """sum(b^2)/sum(b) over the decode steps of requests started together (each generates
    its first token in the prefill step, then one per step)."""
    steps = [sum(1 for n in lengths if n - 1 > k) for k in range(max(lengths))]
    return sum(b * b for b in steps) / max(sum(steps), 1)


def _scenarios(timer: _Timer, rep: int) -> list[tuple[str, Callable[[], Awaitable[Any]],
                                                            list[int] | None]]:  # fmt: skip
    salt = 1000 * (rep + 1)

    def together(lengths: list[int], base: int) -> Callable[[], Awaitable[Any]]:
        return lambda: asyncio.gather(
            *(timer.request(_prompt(salt + base + i), n) for i, n in enumerate(lengths))
        )

    rng = random.Random(rep)

    async def open_churn() -> None:
        tasks = []
        for i in range(40):
            n = rng.randint(5, 60)
            tasks.append(asyncio.create_task(timer.request(_prompt(salt + 400 + i), n)))
            await asyncio.sleep(rng.expovariate(1 / 0.12))
        await asyncio.gather(*tasks)

    async def closed_churn() -> None:
        slots = asyncio.Semaphore(8)

        async def one(i: int, n: int) -> None:
            async with slots:
                await timer.request(_prompt(salt + 600 + i), n)

        await asyncio.gather(*(one(i, rng.randint(5, 60)) for i in range(40)))

    steady, ramp, skewed = (
        [33] * 8,
        [8 * (i + 1) + 1 for i in range(8)],
        [2] * 4 + [120] * 2 + [40] * 2,
    )
    return [
        ("steady 8 x 33", together(steady, 100), steady),
        ("ramp 9..65", together(ramp, 200), ramp),
        ("skewed 2/40/120", together(skewed, 300), skewed),
        ("open churn", open_churn, None),
        ("closed churn of 8", closed_churn, None),
    ]


async def _measure(
    url: str, model_dir: Path, repeats: int
) -> tuple[Calibration, list[dict[str, Any]]]:
    cal = await calibrate(url, SERVED_MODEL, model_dir, 1)
    if cal.engine is None:
        raise SystemExit("the engine's /metrics could not be read")
    model = cal.engine.capacity()
    rows: list[dict[str, Any]] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        timer = _Timer(s, url, SERVED_MODEL)
        for rep in range(repeats):
            for name, load, lengths in _scenarios(timer, rep):
                before = await timer.sample()
                await load()
                await asyncio.sleep(0.3)  # the frontend records the last stats as it answers
                after = await timer.sample()
                if before is None or after is None:
                    raise SystemExit("the engine's /metrics could not be read")
                raw = decode_window(before, after, float("inf"))
                seen = decode_window(before, after, model.local_prefill_rate)
                if raw is None or seen is None:
                    continue
                kv = raw.batch * (SHORT_KV + PROMPT)
                at_mean = model.decode_step_s(raw.batch, kv)
                row = {"scenario": name, "repeat": rep, "steps": raw.steps, "batch": raw.batch,
                       "step_s": raw.step_s, "window_step_s": seen.step_s, "model_s": at_mean,
                       "excess": seen.step_s / at_mean - 1.0}  # fmt: skip
                if lengths is not None:
                    eff = _token_weighted_batch(lengths)
                    row["token_weighted_batch"] = eff
                    row["excess_at_token_weighted"] = (
                        seen.step_s / model.decode_step_s(eff, eff * (SHORT_KV + PROMPT)) - 1.0
                    )
                rows.append(row)
                print(f"{name:18s} rep {rep}: step {1e3 * raw.step_s:6.3f} ms at batch "
                      f"{raw.batch:5.2f} ({raw.steps:4.0f} steps); window {1e3 * seen.step_s:6.3f}"
                      f" ms; model {1e3 * at_mean:6.3f} ms: {row['excess']:+6.1%}"
                      + (f"; at the token-weighted batch {row['token_weighted_batch']:.2f}: "
                         f"{row['excess_at_token_weighted']:+6.1%}" if lengths else ""),
                      flush=True)  # fmt: skip
    return cal, rows


async def _main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="prorsa-decode-step-") as tmp:
        work = Path(tmp)
        model_dir = make_tiny_model(work / "tiny-llama")
        redis = RedisServer(work / "redis").start()
        (work / "logs").mkdir()
        cfg = StackConfig(model=model_dir, workdir=work / "logs", redis_url=redis.url,
                          roles=[Role.MIXED])  # fmt: skip
        try:
            print("starting one vLLM worker on the CPU (the first start compiles: minutes)")
            with LocalStack(cfg) as stack:
                cal, rows = await _measure(stack.workers[0].url, model_dir, args.repeats)
        finally:
            redis.stop()
    e = cal.engine
    assert e is not None
    print(f"calibration (engine-timed): step {1e3 * e.decode_step_s:.3f} ms at one sequence, "
          f"+{1e3 * e.decode_s_per_seq:.3f} ms/seq, +{1e6 * e.decode_s_per_kv_token:.3f} us/KV "
          f"token; prefill {e.prefill_tokens_per_s:.0f} tok/s")  # fmt: skip
    if args.json is not None:
        doc = {"calibration": e.__dict__ | {"engine": None}, "rows": rows}
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.json}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=2, help="times through the scenarios")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    asyncio.run(_main(ap.parse_args()))


if __name__ == "__main__":
    main()
