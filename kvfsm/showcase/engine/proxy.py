"""A P/D router in front of two OpenAI servers, as a disaggregated deployment runs one: each completion goes to
the prefill server for one token with ``kv_transfer_params={"do_remote_decode": true}``, then to the decode server
with the ``kv_transfer_params`` the prefill returned, and the decode server's answer (streamed or not) goes back.

The router only carries the params; the KV moves between the engines through the connector. It serves
``/v1/completions``, ``/v1/models`` and ``/health`` on 127.0.0.1, so vLLM's ``bench serve`` client can point at it.
A WRITE-mode connector whose decode request must go out with the prefill's (MoRIIO's) names its up-front params
with ``concurrent`` (see :class:`~kvfsm.showcase.engine.pd.PDConnector`).
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from collections.abc import Mapping
from typing import Any

import aiohttp
from aiohttp import web

from .pd import DECODE, PREFILL, PDConnector


class PDRouter:
    """The router's state: the two upstream servers, the connector's params, counts of what went through."""

    def __init__(self, prefill_url: str, decode_url: str, connector: PDConnector) -> None:
        self.prefill_url = prefill_url
        self.decode_url = decode_url
        self.connector = connector
        self.routed = 0
        self.failed = 0
        self._session: aiohttp.ClientSession | None = None

    async def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600))
        return self._session

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body: dict[str, Any] = await request.json()
        key = uuid.uuid4().hex
        session = await self.session()
        prefill_body = {
            **body,
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": self.connector.prefill_params(key),
        }
        prefill_body.pop("stream_options", None)
        try:
            if self.connector.concurrent:
                decode_params = self.connector.decode_params(key, None)
                prefill = asyncio.ensure_future(self._post(session, self.prefill_url, prefill_body))
            else:
                answer = await self._post(session, self.prefill_url, prefill_body)
                decode_params = self.connector.decode_params(key, answer.get("kv_transfer_params"))
            decode_body = {**body, "kv_transfer_params": decode_params}
            async with session.post(f"{self.decode_url}/v1/completions", json=decode_body) as upstream:
                response = web.StreamResponse(status=upstream.status, headers={"Content-Type": upstream.content_type})
                await response.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                if self.connector.concurrent:
                    await prefill
                self.routed += 1  # before the client can see the end of its answer
                await response.write_eof()
        except (aiohttp.ClientError, ValueError, RuntimeError) as exc:
            self.failed += 1
            return web.json_response({"error": {"message": f"P/D router: {exc}"}}, status=502)
        return response

    @staticmethod
    async def _post(session: aiohttp.ClientSession, url: str, body: Mapping[str, Any]) -> dict[str, Any]:
        async with session.post(f"{url}/v1/completions", json=body) as response:
            text = await response.text()
            if response.status != 200:
                raise RuntimeError(f"{url} answered {response.status}: {text[:300]}")
            answer: dict[str, Any] = json.loads(text)
            return answer

    async def passthrough(self, request: web.Request) -> web.Response:
        session = await self.session()
        async with session.get(f"{self.decode_url}{request.path}") as upstream:
            return web.Response(status=upstream.status, body=await upstream.read(), content_type=upstream.content_type)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


class Router:
    """The router on its own event loop thread; a context manager that stops it."""

    def __init__(self, prefill_url: str, decode_url: str, connector: PDConnector, port: int) -> None:
        self.state = PDRouter(prefill_url, decode_url, connector)
        self.url = f"http://127.0.0.1:{port}"
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._serve, args=(port,), name="kvfsm-pd-router", daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the P/D router did not start within 30 s")

    def _serve(self, port: int) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/v1/completions", self.state.completions)
        app.router.add_get("/v1/models", self.state.passthrough)
        app.router.add_get("/health", self.state.passthrough)
        self._runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", port).start())
        self._ready.set()
        self._loop.run_forever()

    def close(self) -> None:
        async def stop() -> None:
            await self.state.close()
            if self._runner is not None:
                await self._runner.cleanup()

        if self._loop.is_running():
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=30)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)

    def __enter__(self) -> Router:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


ROLES = (PREFILL, DECODE)
