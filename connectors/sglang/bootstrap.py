"""SGLang's bootstrap server for the `hybridkv` backend: with a shared secret, only routes and questions
MACed under it, and the answers a decode acts on MACed back (routes.py says what is signed and why)."""

from __future__ import annotations

import json

from aiohttp import web

from hybridkv.connectors.sglang import routes
from hybridkv.connectors.sglang.config import SGLangConfig
from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer


class HybridKVBootstrapServer(CommonKVBootstrapServer):
    """SGLang's bootstrap server. With a shared secret, a route (PUT /route) is taken only MACed under it
    over a nonce this server issued (routes.py); anything else is answered 403 and changes nothing. A rank's
    route (GET /route) and the DP ranks of rooms (/query_dp_ranks) are answered MACed to a question MACed
    under it (a rank's route is answered unMACed to SGLang's own question), with a MAC over the question's
    nonce and the answer."""

    def __init__(self, host: str, port: int):
        secret = SGLangConfig.from_server_args(None).secret()  # the ranks' environment: one launch
        self.route_guard = routes.RouteGuard(secret) if secret is not None else None
        super().__init__(host, port)

    def _setup_routes(self):
        super()._setup_routes()
        if self.route_guard is not None:
            self.app.router.add_get(routes.NONCE_PATH, self._handle_route_nonce)

    async def _handle_route_nonce(self, request: web.Request):
        return web.json_response({"nonce": self.route_guard.nonce()})

    async def _handle_route_put(self, request: web.Request):
        if self.route_guard is not None:
            why = self.route_guard.check(await _json_or_none(request))
            if why is not None:
                return web.Response(text=f"hybridkv: route refused: {why}", status=403)
        return await super()._handle_route_put(request)

    async def _handle_register_dp_rank(self, request: web.Request):
        if self.route_guard is not None:
            why = self.route_guard.check_dp_rank(await _json_or_none(request))
            if why is not None:
                return web.Response(text=f"hybridkv: DP rank registration refused: {why}", status=403)
        return await super()._handle_register_dp_rank(request)

    async def _handle_route_get(self, request: web.Request):
        if self.route_guard is None:
            return await super()._handle_route_get(request)
        query = dict(request.query)
        why = self.route_guard.check_lookup(query)
        if why is not None:
            return web.Response(text=f"hybridkv: route lookup refused: {why}", status=403)
        answer = await super()._handle_route_get(request)
        if answer.status != 200 or not routes.is_rank_lookup(query) or not routes.wants_sealed_answer(query):
            return answer  # SGLang's own questions, the parallel info and SGLang's refusals as SGLang answers them
        return web.json_response(self.route_guard.seal_lookup(query, json.loads(answer.text)))

    async def _handle_query_dp_ranks(self, request: web.Request):
        if self.route_guard is None:
            return await super()._handle_query_dp_ranks(request)
        question = await _json_or_none(request)
        why = self.route_guard.check_dp_query(question)
        if why is not None:
            return web.Response(text=f"hybridkv: DP rank query refused: {why}", status=403)
        answer = await super()._handle_query_dp_ranks(request)
        if answer.status != 200:
            return answer
        return web.json_response(self.route_guard.seal_dp_answer(question, json.loads(answer.text)))


async def _json_or_none(request: web.Request):
    try:
        return await request.json()
    except ValueError:
        return None


__all__ = ["HybridKVBootstrapServer"]
