"""Each worker's HTTP port: `/metrics` for Prometheus, `/live` and `/ready` for orchestrators.

`/live` answers while the event loop runs; `/ready` answers 200 only when the worker's own check
says it can take work (engine warm, consumer bound), else 503 with the reason.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

log = structlog.get_logger(__name__)

# Returns None when ready, or why not.
ReadinessCheck = Callable[[], str | None]


async def metrics(request: web.Request) -> web.Response:
    """This process's Prometheus series (a worker's port, and the gateway's own)."""
    return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})


class HealthServer:
    def __init__(self, host: str, port: int, readiness: ReadinessCheck, extra_routes: list[web.RouteDef] = ()) -> None:  # type: ignore[assignment]
        self._host = host
        self._port = port
        self._readiness = readiness
        self._app = web.Application()
        self._app.add_routes(
            [web.get("/metrics", metrics), web.get("/live", self._live), web.get("/ready", self._ready)]
        )
        self._app.add_routes(list(extra_routes))
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    @property
    def url(self) -> str:
        return f"http://{self._host}:{self.port}"

    async def start(self) -> None:
        self._runner = web.AppRunner(self._app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._port)
        await site.start()
        # Port 0 asks the OS for a free one; report the one we got.
        server = site._server  # aiohttp keeps the asyncio server here
        assert server is not None and server.sockets
        self.port = int(server.sockets[0].getsockname()[1])
        log.info("http.listening", url=self.url)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _live(self, request: web.Request) -> web.Response:
        return web.json_response({"live": True})

    async def _ready(self, request: web.Request) -> web.Response:
        reason = self._readiness()
        if reason is None:
            return web.json_response({"ready": True})
        return web.json_response({"ready": False, "reason": reason}, status=503)
