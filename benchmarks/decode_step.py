"""The decode step a real engine runs under a rollout's load, beside its calibration.

The controller learns the decode step online from each engine's `/metrics` (the mean step
between tokens at the mean batch, `control/engine_metrics.decode_window`, with the prefill
tokens the engine computed itself beside it); the offline calibration times one steady batch.
This benchmark shows how the two part on one real vLLM worker (the tiny model, the mixed
role, no router): the same engine, calibrated, then loaded the ways a rollout loads it, each
window read from its `/metrics`:

- steady: 8 sequences of 33 tokens at once (the calibration's own batch);
- ramp and skewed: sequences of different lengths started together, so the batch shrinks as
  they end. The mean step between tokens weights each step by its batch; under the linear
  model it is the step at sum(b^2)/sum(b), not at the mean batch the controller pairs it
  with. The row prints the model at both batches (both are known here);
- open churn: 40 requests arriving at random (mean gap 0.12 s), random lengths;
- closed churn: 40 requests, a new one whenever one of 8 ends (a batch near 8 that turns over).

With `--pd` the stack is a prefill and a decode worker; the decode engine is calibrated and
loaded alone, then beside the prefill engine kept busy with prompt-only requests, then through
the router, every prompt's KV arriving over NIXL (the e2e's pair). `--prompt` sets the
prompts' size (the e2e's turns are ~200 tokens).

Each row: the engine's mean step, the mean batch, the window's step with the engine's own
prefill taken out at the calibrated prefill rate (what the controller did before it learned
that cost as a term of its own) and the calibrated model at that batch and KV, with the
excess. Asserts nothing; the order of the runs is repeated `--repeats` times.

    .venv/bin/python benchmarks/decode_step.py [--repeats 2] [--pd] [--prompt 16] [--json F]
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
SETUPS = ("alone", "beside", "pd-nixl")
NEIGHBOUR_PROMPT = 200  # tokens of each prompt the busy prefill engine serves (--pd)


def _prompt(salt: int, size: int = PROMPT) -> list[int]:
    """A prompt no other salt shares (its first two tokens spell the salt)."""
    head = [3 + salt % 400, 3 + (salt // 400) % 400]
    return head + [3 + (i * 7 + salt * 13) % 390 for i in range(size - 2)]


def _token_weighted_batch(lengths: list[int]) -> float:
    """sum(b^2)/sum(b) over the decode steps of requests started together (each generates
    its first token in the prefill step, then one per step)."""
    steps = [sum(1 for n in lengths if n - 1 > k) for k in range(max(lengths))]
    return sum(b * b for b in steps) / max(sum(steps), 1)


def _scenarios(timer: _Timer, rep: int, setup: int, size: int) -> list[
    tuple[str, Callable[[], Awaitable[Any]], list[int] | None]]:  # fmt: skip
    """The loads of repeat `rep`; prompts differ per setup, so no prefix is cached."""
    salt = 1000 * (rep + 1) + 100_000 * setup

    def together(lengths: list[int], base: int) -> Callable[[], Awaitable[Any]]:
        return lambda: asyncio.gather(
            *(timer.request(_prompt(salt + base + i, size), n) for i, n in enumerate(lengths))
        )

    rng = random.Random(rep)

    async def open_churn() -> None:
        tasks = []
        for i in range(40):
            n = rng.randint(5, 60)
            tasks.append(asyncio.create_task(timer.request(_prompt(salt + 400 + i, size), n)))
            await asyncio.sleep(rng.expovariate(1 / 0.12))
        await asyncio.gather(*tasks)

    async def closed_churn() -> None:
        slots = asyncio.Semaphore(8)

        async def one(i: int, n: int) -> None:
            async with slots:
                await timer.request(_prompt(salt + 600 + i, size), n)

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


async def _prefill_load(timer: _Timer, stop: asyncio.Event) -> int:
    """Keep a prefill engine busy with prompt-only requests until `stop` (the neighbour's
    load in a disaggregated pair); returns how many it served."""
    n = 0
    while not stop.is_set():
        await timer.request(_prompt(1_000_000 + n, NEIGHBOUR_PROMPT), 1)
        n += 1
    return n


async def _measure(
    cal: Calibration,
    load_url: str,
    read_url: str,
    busy_url: str | None,
    repeats: int,
    label: str,
    prompt: int,
) -> list[dict[str, Any]]:
    """Run the scenarios against `load_url` and read the decode engine at `read_url`; with
    `busy_url`, a prefill engine there is kept busy meanwhile."""
    assert cal.engine is not None
    model = cal.engine.capacity()
    rows: list[dict[str, Any]] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        load, read = _Timer(s, load_url, SERVED_MODEL), _Timer(s, read_url, SERVED_MODEL)
        for rep in range(repeats):
            for name, run, lengths in _scenarios(load, rep, SETUPS.index(label), prompt):
                stop = asyncio.Event()
                busy = (
                    asyncio.create_task(_prefill_load(_Timer(s, busy_url, SERVED_MODEL), stop))
                    if busy_url
                    else None
                )
                before = await read.sample()
                await run()
                await asyncio.sleep(0.3)  # the frontend records the last stats as it answers
                after = await read.sample()
                stop.set()
                if busy is not None:
                    await busy
                if before is None or after is None:
                    raise SystemExit("the engine's /metrics could not be read")
                raw = decode_window(before, after, float("inf"))
                seen = decode_window(before, after, model.local_prefill_rate)
                if raw is None or seen is None:
                    continue
                kv = raw.batch * (SHORT_KV + prompt)
                at_mean = model.decode_step_s(raw.batch, kv)
                received = (after.received_tokens - before.received_tokens) / raw.steps
                row = {"setup": label, "scenario": name, "repeat": rep, "steps": raw.steps,
                       "batch": raw.batch, "step_s": raw.step_s, "window_step_s": seen.step_s,
                       "model_s": at_mean, "excess": seen.step_s / at_mean - 1.0,
                       "received_tokens_per_step": received}  # fmt: skip
                if lengths is not None:
                    eff = _token_weighted_batch(lengths)
                    row["token_weighted_batch"] = eff
                    row["excess_at_token_weighted"] = (
                        seen.step_s / model.decode_step_s(eff, eff * (SHORT_KV + prompt)) - 1.0
                    )
                rows.append(row)
                print(f"{label:9s} {name:18s} rep {rep}: step {1e3 * raw.step_s:6.3f} ms at "
                      f"batch {raw.batch:5.2f} ({raw.steps:4.0f} steps); window "
                      f"{1e3 * seen.step_s:6.3f} ms; model {1e3 * at_mean:6.3f} ms: "
                      f"{row['excess']:+6.1%}"
                      + (f"; {received:.0f} KV tokens received per step" if received else "")
                      + (f"; at the token-weighted batch {row['token_weighted_batch']:.2f}: "
                         f"{row['excess_at_token_weighted']:+6.1%}" if lengths else ""),
                      flush=True)  # fmt: skip
    return rows


async def _run(stack: LocalStack, model_dir: Path, a: argparse.Namespace) -> tuple[
    Calibration, list[dict[str, Any]]]:  # fmt: skip
    """Calibrate the decode engine, then load it alone, then (a pair) beside a busy prefill
    engine, then through the router, its KV arriving over NIXL."""
    engine = stack.workers[-1].url
    cal = await calibrate(engine, SERVED_MODEL, model_dir, 1)
    if cal.engine is None:
        raise SystemExit("the engine's /metrics could not be read")
    rows = await _measure(cal, engine, engine, None, a.repeats, "alone", a.prompt)
    if a.pd:
        neighbour = stack.workers[0].url
        rows += await _measure(cal, engine, engine, neighbour, a.repeats, "beside", a.prompt)
        rows += await _measure(cal, stack.router_url, engine, None, a.repeats, "pd-nixl", a.prompt)
    return cal, rows


async def _main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="prorsa-decode-step-") as tmp:
        work = Path(tmp)
        model_dir = make_tiny_model(work / "tiny-llama")
        redis = RedisServer(work / "redis").start()
        (work / "logs").mkdir()
        roles = [Role.PREFILL, Role.DECODE] if args.pd else [Role.MIXED]
        cfg = StackConfig(model=model_dir, workdir=work / "logs", redis_url=redis.url,
                          roles=roles)  # fmt: skip
        try:
            print(f"starting {len(roles)} vLLM worker(s) on the CPU (a first start compiles)")
            with LocalStack(cfg) as stack:
                cal, rows = await _run(stack, model_dir, args)
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
    ap.add_argument("--pd", action="store_true",
                    help="a prefill and a decode worker: also beside a busy prefill engine, "
                         "and through the router with the KV over NIXL")  # fmt: skip
    ap.add_argument("--prompt", type=int, default=PROMPT, help="tokens of each prompt")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    asyncio.run(_main(ap.parse_args()))


if __name__ == "__main__":
    main()
