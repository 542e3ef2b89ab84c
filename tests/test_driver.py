"""The local agent loop against an endpoint that is away for a moment: a turn the router
never answered is sent again (and counted), a refusal is not, and lost hints fail nothing."""

from __future__ import annotations

import asyncio

from aiohttp import web

from prorsa.local.driver import drive
from prorsa.local.processes import free_port
from prorsa.sim.workload import TrajectoryScript, Turn


def _scripts(n: int) -> list[TrajectoryScript]:
    return [TrajectoryScript(f"t{i}", "g", (Turn(4, 2, 0.01), Turn(3, 2, 0.0))) for i in range(n)]


async def _endpoint(port: int, status: int = 200) -> web.AppRunner:
    async def turn(request: web.Request) -> web.Response:
        if status != 200:
            return web.json_response({"error": {"message": "no"}}, status=status)
        return web.json_response({"choices": [{"text": "ab", "token_ids": [5, 6]}]})

    app = web.Application()
    app.router.add_post("/v1/completions", turn)  # no hint routes: hints get 404s
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


def test_turns_are_retried_while_the_endpoint_is_away() -> None:
    async def main() -> None:
        port = free_port()

        async def late_start() -> web.AppRunner:
            await asyncio.sleep(1.0)
            return await _endpoint(port)

        server = asyncio.create_task(late_start())
        r = await drive(f"http://127.0.0.1:{port}", _scripts(3), model="m", retry_s=10.0)
        await (await server).cleanup()
        assert r.turns_ok == 6 and r.turns_failed == 0 and r.retries >= 3
        assert r.turns_by_trajectory == {"t0": 2, "t1": 2, "t2": 2}

    asyncio.run(main())


def test_without_retries_or_on_a_refusal_the_trajectory_stops() -> None:
    async def main() -> None:
        port = free_port()
        r = await drive(f"http://127.0.0.1:{port}", _scripts(2), model="m")
        assert r.turns_ok == 0 and r.turns_failed == 2 and r.retries == 0
        server = await _endpoint(port, status=400)
        try:
            r = await drive(f"http://127.0.0.1:{port}", _scripts(2), model="m", retry_s=5.0)
        finally:
            await server.cleanup()
        assert r.turns_failed == 2 and r.retries == 0 and "HTTP 400" in r.errors[0]

    asyncio.run(main())
