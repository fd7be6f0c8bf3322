"""The gateway service: `specmesh.v1.Gateway` (Generate, GenerateStream) over drafter and verifier
pools, with the sessions in Redis. Docs: docs/gateway.md.

    python -m gateway --port 50051 --drafters A[,A…] --verifiers A[,A…] --redis-url redis://…

Start-up: the server listens at once but reports NOT_SERVING (health, and UNAVAILABLE to
requests) until it has learnt the model: it asks a healthy verifier for Info, loads the tokenizer
(--tokenizer, else the verifier's --model; no weights), checks that its fingerprint is the
verifier's, and takes the context length from the model config (unless --max-context).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import hashlib
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2

from gateway.api import SESSION_ID_METADATA, gateway_pb2, gateway_pb2_grpc, logprobs_to_proto
from gateway.config import GatewayConfig, key_list, parse_config
from gateway.env import GatewayEnv, GatewayError, Piece
from gateway.http.app import create_app
from gateway.http.server import HttpServer
from gateway.metrics import GatewayMetrics, RequestClock
from gateway.model import ServedModel, learn_model
from gateway.pools import NoHealthyReplica, ReplicaPool
from gateway.prefixes import PrefixRouting
from gateway.requests import (
    GenerationPlan,
    parse_generate_request,
    plan_from_session,
)
from gateway.retries import RetryBudget
from gateway.session import DsiShape, SessionRun
from gateway.session_store import (
    NotOwner,
    Session,
    SessionNotFound,
    SessionStore,
    StoreError,
    StoreUnavailable,
)
from gateway.speculation import dsi_shape, plan_speculation, servable
from gateway.text import TextStream
from specmesh.core.adaptive import ForwardCost, RoundPolicy
from specmesh.core.ahead import PipelinePolicy
from specmesh.core.rounds import Pipelining
from specmesh.rpc import wire
from specmesh.rpc.flags import ServerConfig
from specmesh.rpc.server import (
    RpcService,
    configure_logging,
    rpc,
    rpc_stream,
    serve,
)
from specmesh.rpc.tick_client import Role

log = logging.getLogger("specmesh.gateway")

MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # requests are prompts, answers text and token ids
NO_DEADLINE = 1e9  # time_remaining() above this (or None): the client set no deadline
HANDOVER_SHARE = 0.8  # of --grace-seconds that running sessions may use to finish before a handover
TAKE_SLACK_SECONDS = 0.5  # a resume waits for a dead owner's lease this much past its expiry
READY_RETRY_SECONDS = 5.0  # between attempts to learn the model (a verifier starting, a bad tokenizer)


class GatewayService(RpcService, gateway_pb2_grpc.GatewayServicer):
    service_name = "Gateway"
    pb2_module = gateway_pb2
    grpc_module = gateway_pb2_grpc

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.metrics = GatewayMetrics(config.served_model_name)  # else the verifier's, once learnt
        pool_options = {
            "health_interval": config.health_interval,
            "idle_health_interval": config.idle_health_interval,
            "tls": config.replica_tls(),
        }
        ticks = {role: self.metrics.answer_tick.labels(role.value).observe for role in Role}
        drafting = {**pool_options, "role": Role.DRAFTER, "on_tick": ticks[Role.DRAFTER]}
        routing: dict[str, PrefixRouting] = {}  # pool name -> its routing (--prefix-routing)

        def model_pool(name: str, **options: Any) -> dict[str, Any]:
            """A model replica pool's options: chunked prefill, its prefix summaries."""
            if config.prefix_routing:
                options["on_prefix_version"] = lambda a, v: routing[name].seen(a, v)
            return options  # the prefill chunk is set once the replicas' costs are known

        drafters = None
        if config.drafters:
            drafters = ReplicaPool(config.drafters, name="drafter", **model_pool("drafter", **drafting))
        ngram = config.ngram_drafters  # no model: a prompt costs it nothing, no chunks, no prefixes
        ngram_drafters = ReplicaPool(ngram, name="ngram-drafter", **drafting) if ngram else None
        store = SessionStore(
            config.redis_url,
            ttl_seconds=config.session_ttl,
            lease_seconds=config.lease_seconds,
            reconnect_timeout=config.redis_reconnect_seconds,
            # a session uses one connection at a time; its cleanup may briefly need another
            max_connections=2 * config.max_concurrent_requests + 8 if config.max_concurrent_requests else 128,
        )
        verifying = {**pool_options, "role": Role.VERIFIER, "on_tick": ticks[Role.VERIFIER]}
        verifiers = ReplicaPool(config.verifiers, name="verifier", **model_pool("verifier", **verifying))
        if config.prefix_routing:
            for pool in (p for p in (drafters, verifiers) if p is not None):
                routing[pool.name] = PrefixRouting(store, pool, config.prefix_balance)
        self.env = GatewayEnv(
            store=store,
            drafters=drafters,
            ngram_drafters=ngram_drafters,
            verifiers=verifiers,
            routing=routing,
            metrics=self.metrics,
            round_timeout=config.round_timeout,
            max_attempts=config.max_attempts,
            retries=RetryBudget(ratio=config.retry_budget),
            pipeline=PipelinePolicy(Pipelining.parse(config.pipeline)),
            dsi_timeline=Path(config.dsi_timeline) if config.dsi_timeline else None,
            plain_steps=config.plain_steps,
            suffix_rides=config.suffix_rides,
        )
        self.metrics.kv_usage.set_function(verifiers.kv_usage)
        self.model: ServedModel | None = None
        self._not_ready = "waiting for a healthy verifier to learn the model"
        self._ready_task: asyncio.Task | None = None
        self._api_keys = key_list(config.api_keys)
        self._private_tenants = frozenset(tenant_of(k) for k in key_list(config.private_api_keys))
        self._admitted = 0  # generate() calls in progress (the admission limit counts these)
        self._runs: set[SessionRun] = set()  # sessions running here (handed over on SIGTERM)
        self._draining = False
        self._http: HttpServer | None = None
        # one thread: requests are tokenized in turn, off the event loop (a tokenizer is not
        # meant to encode from several threads at once)
        self._parser = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="parse")

    # ---- lifecycle -----------------------------------------------------------------------------

    async def started(self, health_servicer: health.aio.HealthServicer) -> None:
        for name in ("", self.full_name):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        for pool in self._pools():
            await pool.start()
        self._ready_task = asyncio.create_task(self._become_ready(health_servicer), name="gateway-ready")

    async def serve_more(self, config: ServerConfig) -> None:
        if self.config.http_port:
            tls = self.config.server_tls()
            self._http = HttpServer(create_app(self), self.config.host, self.config.http_port, tls)
            await self._http.start()

    async def drain(self, grace_seconds: float) -> None:
        """SIGTERM (a rollout): no new sessions; running ones may finish for most of the grace
        period, then the rest are handed over (each stream ends with UNAVAILABLE and the session
        stays in Redis, its lease released, for the client to resume on another gateway)."""
        self._draining = True
        for run in self._runs:
            run.keep()
        waits = [self._hand_over_after(grace_seconds * HANDOVER_SHARE)]
        if self._http is not None:
            waits.append(self._http.stop(grace_seconds))
        await asyncio.gather(*waits)

    async def _hand_over_after(self, seconds: float) -> None:
        deadline = asyncio.get_running_loop().time() + seconds
        while self._runs and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        for run in list(self._runs):
            run.hand_over()
        log.info("handed sessions over", extra={"sessions": len(self._runs)})

    async def close(self) -> None:
        if self._ready_task is not None:
            self._ready_task.cancel()
            await asyncio.gather(self._ready_task, return_exceptions=True)
        await asyncio.gather(*self.env.cleanups, return_exceptions=True)
        await self.env.leases.close()
        for task in list(self.env.deferred):
            task.cancel()
        await asyncio.gather(*self.env.deferred, return_exceptions=True)
        for routing in self.env.routing.values():
            await routing.close()
        for pool in self._pools():
            await pool.close()
        await self.env.store.close()
        self._parser.shutdown(wait=False)

    def _pools(self) -> list[ReplicaPool]:
        env = self.env
        return [p for p in (env.drafters, env.ngram_drafters, env.verifiers) if p is not None]

    async def _become_ready(self, health_servicer: health.aio.HealthServicer) -> None:
        while self.model is None:
            try:
                self.model = await learn_model(self.env, self.config)
                self.metrics.model_name = self.model_name()
            except Exception as exc:  # retried: the verifier may be starting or being replaced
                self._not_ready = f"cannot learn the model yet: {exc}"
                log.warning("not ready", extra={"reason": self._not_ready})
                await asyncio.sleep(READY_RETRY_SECONDS)
        for name in ("", self.full_name):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "ready",
            extra={"vocab_size": self.model.limits.vocab_size, "context": self.model.limits.max_context},
        )

    # ---- errors --------------------------------------------------------------------------------

    def undecodable(self, request: Any, context: grpc.aio.ServicerContext) -> Exception:
        """Bytes that are no GenerateRequest: the API key first, as for any other request (a caller
        without one learns nothing of the API)."""
        self.authorize(_authorization(context))
        return super().undecodable(request, context)

    def status(self, method: str, session: str, exc: Exception) -> tuple[grpc.StatusCode, str, tuple]:
        if isinstance(exc, GatewayError):
            return exc.code, str(exc), ()
        if isinstance(exc, StoreUnavailable | NoHealthyReplica):
            return grpc.StatusCode.UNAVAILABLE, str(exc), ()
        if isinstance(exc, SessionNotFound):
            return grpc.StatusCode.ABORTED, f"session store: {exc}", ()
        if isinstance(exc, StoreError):
            return grpc.StatusCode.INTERNAL, str(exc), ()
        return super().status(method, session, exc)

    # ---- RPCs ----------------------------------------------------------------------------------

    @rpc
    async def Generate(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        tenant = self.authorize(_authorization(context))
        generated = self.generate(request, self._deadline(context), tenant=tenant)
        async with contextlib.aclosing(generated) as generated:
            chunks = [c async for c in generated]
        last = chunks[-1]
        return gateway_pb2.GenerateResponse(
            text="".join(c.text for c in chunks),
            token_ids=[t for c in chunks for t in c.token_ids],
            logprobs=[t for c in chunks for t in c.logprobs],
            finish_reason=last.finish_reason,
            stats=last.stats,
            session_id=last.session_id,
        )

    @rpc_stream
    async def GenerateStream(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        tenant = self.authorize(_authorization(context))

        async def announce(session_id: str) -> None:
            await context.send_initial_metadata(((SESSION_ID_METADATA, session_id),))

        generated = self.generate(request, self._deadline(context), announce, tenant)
        async with contextlib.aclosing(generated) as chunks:
            async for chunk in chunks:
                yield chunk

    # ---- what gRPC and HTTP share --------------------------------------------------------------

    def authorize(self, authorization: str | None) -> bytes:
        """authorization: the request's `authorization` (gRPC metadata, HTTP header), "Bearer KEY".
        -> the key's prefix cache namespace (a hash of it; b"" without API keys): requests of
        different keys never start from each other's cached prompts (docs/gateway.md)."""
        if not self._api_keys:
            return b""
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise GatewayError(
                grpc.StatusCode.UNAUTHENTICATED, "authorization: this gateway needs an API key (Bearer)"
            )
        if not any(hmac.compare_digest(token.encode(), key) for key in self._api_keys):
            raise GatewayError(grpc.StatusCode.UNAUTHENTICATED, "authorization: invalid API key")
        return tenant_of(token.encode())

    def served_model(self) -> ServedModel:
        """The model being served; UNAVAILABLE until the gateway has learnt it."""
        if self.model is None:
            raise GatewayError(grpc.StatusCode.UNAVAILABLE, f"gateway not ready: {self._not_ready}")
        return self.model

    def token_text(self, token_id: int) -> str:
        """One token's text, as the HTTP API's logprobs name it (vLLM's: the token decoded alone)."""
        return self.served_model().tokenizer.decode([token_id])

    def tool_call_parser(self) -> str:
        """--tool-call-parser (the HTTP API's)."""
        return self.config.tool_call_parser

    def model_name(self) -> str:
        """The model's name in the HTTP API: --served-model-name, else the verifier's model id."""
        return self.config.served_model_name or self.served_model().name

    async def generate(
        self,
        request: Any,
        deadline: float | None,
        announce: Callable[[str], Awaitable[None]] | None = None,
        tenant: bytes = b"",
    ) -> AsyncIterator[Any]:
        """request: a specmesh.v1.GenerateRequest -> its GenerateChunks, one per committed round;
        the last carries finish_reason and stats. Validated (WireError) before anything is stored
        or sent to a replica. Close it (aclosing) or cancel its consumer to end the session.
        announce(session id): called as soon as the session exists, before its first round (a
        gRPC stream's initial metadata): a client cut off before its first chunk can resume too.
        tenant: its API key's prefix cache namespace (`authorize`)."""
        model = self.served_model()
        if self._draining:
            raise GatewayError(grpc.StatusCode.UNAVAILABLE, "the gateway is shutting down; retry on another")
        limit = self.config.max_concurrent_requests
        if limit and self._admitted >= limit:
            raise GatewayError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the gateway is serving its limit of {limit} requests (--max-concurrent-requests); "
                "retry later",
            )
        m, clock = self.metrics, RequestClock(self.metrics)
        self._admitted += 1
        m.waiting.inc()
        waiting = True
        run: SessionRun | None = None
        try:
            if request.HasField("resume"):
                run, replay = await self._resumed_run(request.resume, deadline)
            else:
                plan = await self._new_plan(request, model, tenant)
                text = TextStream(model.tokenizer, plan.stop, context=plan.prompt_ids)
                run, replay = await self._session_run(plan, text, deadline), None
            plan = run.plan
            async with run:
                self._runs.add(run)
                if announce is not None:
                    await announce(run.id)
                clock.started()
                m.prompt_tokens.inc(len(plan.prompt_ids))
                while replay is not None or not run.transcript.finished:
                    piece, replay = (replay, None) if replay is not None else (await run.step(), None)
                    if waiting:  # its first token: it no longer waits (its prompt is in)
                        m.waiting.dec()
                        waiting = False
                    clock.chunk(len(piece.token_ids))
                    chunk = gateway_pb2.GenerateChunk(
                        text=piece.text, token_ids=piece.token_ids, session_id=run.id,
                        logprobs=logprobs_to_proto(piece.logprobs),
                    )  # fmt: skip
                    if run.transcript.finished:
                        chunk.finish_reason = run.transcript.finish_reason
                        chunk.stats.CopyFrom(run.stats_message())
                        clock.finished(run.transcript.finish_reason)
                    yield chunk
                log.debug(
                    "generated",
                    extra={
                        "session": run.id,
                        "prompt_tokens": len(plan.prompt_ids),
                        "tokens": run.transcript.generated,
                        "rounds": run.transcript.round,
                        "finish_reason": run.transcript.finish_reason,
                        "method": plan.spec.method,
                    },
                )
        finally:
            self._admitted -= 1
            if run is not None:
                self._runs.discard(run)
            if waiting:
                m.waiting.dec()

    async def _new_plan(self, request: Any, model: ServedModel, tenant: bytes) -> GenerationPlan:
        """The request's plan, servable here; parsed off the event loop (tokenizing, and a chat
        template, may take a while). Every request of a --private-api-keys key is private."""
        private = tenant in self._private_tenants
        parse = functools.partial(
            parse_generate_request, request, model.tokenizer, model.limits, tenant, private
        )
        return servable(await asyncio.get_running_loop().run_in_executor(self._parser, parse), self.env)

    async def _resumed_run(self, resume: Any, deadline: float | None) -> tuple[SessionRun, Piece]:
        """A session another gateway started, taken over (its lease: session_store, "Ownership"),
        and the piece that replays the committed tokens the client lacks."""
        model = self.served_model()
        session_id = wire.session_id_from_proto(resume.session_id, "resume.session_id")
        session = await self._take(session_id, deadline)
        try:
            plan = plan_from_session(session)
            generated = session.generated
            if resume.token_index > len(generated):
                raise wire.WireError(
                    "resume.token_index",
                    f"{resume.token_index} is past the session's {len(generated)} committed tokens",
                )
            text = TextStream(model.tokenizer, plan.stop, context=plan.prompt_ids)
            text.push(generated[: resume.token_index], final=False)  # what the client has
            missing = generated[resume.token_index :]
            replay = Piece(missing, text.push(missing, final=session.finished), session.finish_reason)
            if plan.dsi is not None:  # its shape is chosen again: the same where the request fixed it
                run: SessionRun = await self._dsi_run(plan, text, deadline, resumed=session)
            else:
                policy = None
                if plan.adaptive or plan.auto:  # the policy starts afresh: the shape may differ from here on
                    plan, policy = await asyncio.get_running_loop().run_in_executor(
                        self._parser, self._speculation, plan
                    )
                run = SessionRun(plan, self.env, text, deadline, policy, resumed=session)
        except BaseException:
            with contextlib.suppress(StoreError):
                await self.env.store.release(session_id, session.owner)
            raise
        log.info("resumed", extra={"session": session_id, "from": resume.token_index, "owner": session.owner})
        return run, replay

    async def _take(self, session_id: str, deadline: float | None) -> Session:
        """Take the session over once no other gateway's lease is live: a dead gateway's runs out
        within --lease-seconds; a live owner keeps it (then FAILED_PRECONDITION: one gateway runs
        a session at a time)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + self.env.store.lease_seconds + TAKE_SLACK_SECONDS
        if deadline is not None:
            end = min(end, deadline)
        while True:
            try:
                return await self.env.store.take(session_id)
            except SessionNotFound:
                message = f"resume.session_id: no session {session_id} (finished, expired or unknown)"
                raise GatewayError(grpc.StatusCode.NOT_FOUND, message, "resume.session_id") from None
            except NotOwner as exc:
                if loop.time() + exc.retry_after > end:
                    raise GatewayError(
                        grpc.StatusCode.FAILED_PRECONDITION, f"resume.session_id: {exc}", "resume.session_id"
                    ) from None
                await asyncio.sleep(exc.retry_after + 0.01)

    async def _session_run(
        self, plan: GenerationPlan, text: TextStream, deadline: float | None
    ) -> SessionRun:
        if plan.dsi is None:
            # off the event loop: the prompt's n-gram hit rate is a pass over the whole prompt
            loop = asyncio.get_running_loop()
            plan, policy = await loop.run_in_executor(self._parser, self._speculation, plan)
            return SessionRun(plan, self.env, text, deadline, policy)
        return await self._dsi_run(plan, text, deadline)

    async def _dsi_run(
        self, plan: GenerationPlan, text: TextStream, deadline: float | None, resumed: Session | None = None
    ) -> SessionRun:
        assert plan.dsi is not None
        model = self.served_model()
        verify = ForwardCost(model.forward_cost, decay=0.0).shape
        tree = model.limits.tree  # --max-depth: what a request may ask; replicas' default alike
        shape = await dsi_shape(
            plan.dsi, verify, model.draft_cost, self.env, self.config.dsi_max_parallel, tree.max_depth
        )
        dsi = DsiShape(shape.lookahead, shape.parallel, shape.ahead, verify, tree.max_depth)
        return SessionRun(plan, self.env, text, deadline, resumed=resumed, dsi=dsi)

    def _speculation(self, plan: GenerationPlan) -> tuple[GenerationPlan, RoundPolicy | None]:
        """`plan_speculation` for the served model (in the parse thread)."""
        return plan_speculation(plan, self.served_model(), self.env, self.config)

    @staticmethod
    def _deadline(context: grpc.aio.ServicerContext) -> float | None:
        """The client's deadline on the event loop's clock (replica calls must end before it)."""
        remaining = context.time_remaining()
        if remaining is None or remaining > NO_DEADLINE:
            return None
        return asyncio.get_running_loop().time() + remaining


def tenant_of(key: bytes) -> bytes:
    """An API key's namespace: its hash (the replicas and Redis never see a key)."""
    return hashlib.sha256(b"specmesh-api-key:" + key).digest()


def _authorization(context: grpc.aio.ServicerContext) -> str | None:
    """The call's `authorization` metadata entry, if any."""
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return str(value)
    return None


async def _serve(config: GatewayConfig, stop: asyncio.Event | None = None) -> None:
    service = GatewayService(config)
    details = {"drafters": config.drafters, "verifiers": config.verifiers, "http_port": config.http_port}
    details["replica_tls"] = "mutual" if config.replica_cert else bool(config.replica_tls())
    await serve(service, config, MAX_MESSAGE_BYTES, details, stop)


def run(argv: list[str] | None = None) -> None:
    """`python -m gateway`."""
    import uvloop

    config = parse_config(argv)
    configure_logging(config.log_level)
    uvloop.run(_serve(config))
