"""Load through the gateway's two fronts: N concurrent streams for a fixed time over the OpenAI HTTP
API (the official `openai` client) and over gRPC (GenerateStream), same prompts and settings.

    specmesh up --no-demo            # then:
    specmesh bench http --concurrency 8 --duration 60

Each phase runs `concurrency` workers; each streams one completion after another (the prompts in
turn) until `duration` seconds have passed, then finishes the one it is on. tokens/s = generated
tokens / time until the last worker finished. The phases alternate (gRPC, HTTP, gRPC, ...) so a
drift of the machine's speed does not favour one front. Every failed request is counted.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field

import grpc

from specmesh.bench.measure import humaneval_prompts
from specmesh.rpc.proto import load


@dataclass
class Phase:
    front: str  # "grpc" or "http"
    requests: int = 0
    tokens: int = 0
    errors: list[str] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def row(self) -> dict:
        out = asdict(self)
        out["ttft"] = statistics.median(self.ttft) if self.ttft else None
        out["tokens_per_second"] = self.tokens_per_second
        return out


Stream = Callable[[str, Phase], Awaitable[None]]


async def _run(front: str, stream: Stream, prompts: list[str], concurrency: int, duration: float) -> Phase:
    phase = Phase(front)
    start = time.perf_counter()
    turn = iter(range(10**9))

    async def worker() -> None:
        while time.perf_counter() - start < duration:
            prompt = prompts[next(turn) % len(prompts)]
            try:
                await stream(prompt, phase)
                phase.requests += 1
            except Exception as exc:  # counted, the load goes on
                phase.errors.append(f"{type(exc).__name__}: {exc}"[:300])

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    phase.seconds = time.perf_counter() - start
    return phase


def _grpc_stream(address: str, max_new_tokens: int, temperature: float) -> tuple[Stream, grpc.aio.Channel]:
    gateway_pb2, gateway_grpc = load("gateway")
    channel = grpc.aio.insecure_channel(address)
    stub = gateway_grpc.GatewayStub(channel)

    async def stream(prompt: str, phase: Phase) -> None:
        request = gateway_pb2.GenerateRequest(prompt=prompt, max_new_tokens=max_new_tokens)
        request.sampling.temperature = temperature
        sent = time.perf_counter()
        async for chunk in stub.GenerateStream(request, timeout=600):
            if chunk.token_ids and sent:
                phase.ttft.append(time.perf_counter() - sent)
                sent = 0.0
            phase.tokens += len(chunk.token_ids)

    return stream, channel


async def _http_stream(url: str, max_new_tokens: int, temperature: float) -> tuple[Stream, object]:
    try:
        import openai
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(
            "the HTTP load needs the openai client: pip install 'specmesh[bench]'"
        ) from e
    client = openai.AsyncOpenAI(
        base_url=f"{url.rstrip('/')}/v1", api_key="unused", max_retries=0, timeout=600
    )
    model = (await client.models.list()).data[0].id  # the one model the gateway serves

    async def stream(prompt: str, phase: Phase) -> None:
        sent = time.perf_counter()
        events = await client.completions.create(
            model=model, prompt=prompt, max_tokens=max_new_tokens, temperature=temperature, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        async for event in events:
            if sent and event.choices and event.choices[0].text:
                phase.ttft.append(time.perf_counter() - sent)
                sent = 0.0
            if event.usage is not None:
                phase.tokens += event.usage.completion_tokens

    return stream, client


async def _bench(
    address: str, url: str, prompts: list[str], concurrency: int, duration: float, repeats: int,
    max_new_tokens: int, temperature: float,
) -> list[Phase]:  # fmt: skip
    grpc_stream, channel = _grpc_stream(address, max_new_tokens, temperature)
    http_stream, client = await _http_stream(url, max_new_tokens, temperature)
    phases = []
    try:
        for _ in range(repeats):
            for front, stream in (("grpc", grpc_stream), ("http", http_stream)):
                phase = await _run(front, stream, prompts, concurrency, duration)
                phases.append(phase)
                print(
                    f"{front:<4} {phase.requests:4d} requests  {phase.tokens:6d} tokens  "
                    f"{phase.tokens_per_second:6.2f} tok/s  {len(phase.errors)} errors  "
                    f"TTFT p50 {statistics.median(phase.ttft) if phase.ttft else float('nan'):.3f}s",
                    flush=True,
                )
    finally:
        await channel.close()
        await client.close()  # type: ignore[attr-defined]
    return phases


def bench_http(
    address: str = "127.0.0.1:50051",
    url: str = "http://127.0.0.1:8000",
    concurrency: int = 8,
    duration: float = 60.0,
    repeats: int = 1,
    prompts: int = 8,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
) -> dict:
    texts = humaneval_prompts(prompts)
    phases = asyncio.run(
        _bench(address, url, texts, concurrency, duration, repeats, max_new_tokens, temperature)
    )
    rate = {f: sum(p.tokens for p in phases if p.front == f) / sum(p.seconds for p in phases if p.front == f)
            for f in ("grpc", "http")}  # fmt: skip
    ratio = rate["http"] / rate["grpc"] if rate["grpc"] else 0.0
    errors = sum(len(p.errors) for p in phases)
    print(
        f"HTTP {rate['http']:.2f} tok/s vs gRPC {rate['grpc']:.2f} tok/s: x{ratio:.3f} "
        f"(the HTTP layer costs {100 * (1 - ratio):.1f} %); {errors} errors",
        flush=True,
    )
    return dict(
        address=address, url=url, concurrency=concurrency, duration=duration, repeats=repeats,
        max_new_tokens=max_new_tokens, temperature=temperature, date=time.strftime("%Y-%m-%d %H:%M:%S"),
        tokens_per_second=rate, http_over_grpc=ratio, errors=errors, phases=[p.row() for p in phases],
    )  # fmt: skip
