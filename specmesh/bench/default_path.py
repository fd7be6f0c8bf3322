"""The default path on a running stack (`specmesh up`): a request with no speculation field against
method `none`, per prompt set and temperature, at 1..8 concurrent sessions; and whether a seed
gives the same text over three runs through gRPC and HTTP, the third beside a load.

    specmesh up --no-demo &     # then:
    specmesh bench default --json docs/benchmarks/default_path.json

Prompt sets: `chat` (LongBench-Write questions as user messages), `code` (HumanEval prompts to
complete), and three whose answers copy their context, where n-gram drafts apply: `edit`
(HumanEval code to rewrite with a rename), `quote` (a document's paragraphs to quote) and
`rewrite` (a text to give back with one word changed); and the broad copy set (copy_set.py: 8
kinds of copying, 4 prompts each), its tuning half `copy` and its held-out half `copy-held`, the
one to quote (`--sets copy-held --prompts 16`: all of it). What the default chose shows in the
stats: drafted tokens (n-gram rides in the verifier's plain steps, or the draft model's), or none. With
llama-server given, the copying sets also run llama.cpp's own prompt lookup (`llama-lookup`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from specmesh.bench.anchors import find_llama_lookup, llama_server, run_llama_lookup, run_llama_server
from specmesh.bench.measure import COPYING_SETS, PROMPT_SETS, prompt_set, run_gateway
from specmesh.core.drafting import TreeSpec
from specmesh.core.methods import Method
from specmesh.rpc.proto import load

NONE = TreeSpec(Method.NONE)


FIRST_SEED = 1000  # prompt i's seed is FIRST_SEED + i, in every engine
Engine = Callable[[list[str], int], dict]  # (texts, the first one's seed) -> what it measured
GATEWAY_KEYS = (
    "tokens", "seconds", "decode_tokens", "decode_seconds", "accepted_tokens", "drafted_tokens",
    "target_calls", "block_efficiency",
)  # fmt: skip


def compare(
    address: str,
    texts: list[str],
    temperature: float,
    max_new: int,
    sessions: int,
    llama_url: str | None,
    llama_sessions: int = 1,
    lookup: Engine | None = None,
) -> dict:
    """method none and the default on the same prompts and seeds, `sessions` streams at a time;
    with llama_url, llama-server plain on the same texts (when it runs at least `sessions` slots:
    `llama_sessions`); with lookup, llama-lookup too. One session at a time runs the engines
    prompt by prompt (`interleaved`); concurrent streams run each engine's batches in turn."""
    engines: dict[str, Engine] = {}
    if llama_url and sessions <= llama_sessions:
        engines["llama_server"] = lambda t, seed: run_llama_server(
            llama_url, t, temperature, max_new, sessions, first_seed=seed
        )
    if lookup is not None:
        engines["llama_lookup"] = lookup
    for name, spec in (("none", NONE), ("default", None)):
        engines[name] = lambda t, seed, spec=spec: gateway_run(
            address, t, spec, temperature, max_new, sessions, seed
        )
    if sessions == 1:
        measured = interleaved(engines, texts)
    else:
        measured = {name: summed([run(texts, FIRST_SEED)]) for name, run in engines.items()}
    row = {name: with_rates(m) for name, m in measured.items()}
    row.update(ratios(row["default"], row["none"], "none"))
    for base in ("llama_server", "llama_lookup"):
        if base in row:
            row.update(ratios(row["default"], row[base], base))
    if "llama_server" in row:
        row.update(ratios(row["none"], row["llama_server"], "llama_server", "none"))
    return row


def gateway_run(
    address: str, texts: list[str], spec: TreeSpec | None, temperature: float, max_new: int, sessions: int,
    first_seed: int, private: bool = True,
) -> dict:  # fmt: skip
    """One engine's run through the gateway. private (the default): its outputs teach no suffix
    drafter or ride, so that no engine's answer to a prompt becomes another engine's drafts for
    that same prompt (at temperature 0 it would be the exact answer)."""
    m = asyncio.run(
        run_gateway(
            address, texts, spec, False, temperature, max_new, sessions, first_seed=first_seed,
            private=private,
        )
    )  # fmt: skip
    return {k: m[k] for k in GATEWAY_KEYS}


def interleaved(engines: dict[str, Engine], texts: list[str]) -> dict[str, dict]:
    """Every engine on prompt i (seed FIRST_SEED + i) before any on prompt i + 1, the order
    rotated by one each prompt; -> per engine, its prompts' sums. A machine whose speed drifts
    during a run (this 2-core one did by up to 25 % between minutes) then weighs on every engine
    alike, where engine after engine gave one the fast minutes and another the slow ones."""
    names = list(engines)
    parts: dict[str, list[dict]] = {name: [] for name in names}
    for i, text in enumerate(texts):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            parts[name].append(engines[name]([text], FIRST_SEED + i))
    return {name: summed(p) for name, p in parts.items()}


def summed(parts: list[dict]) -> dict:
    """One engine's per-prompt measurements as one: counts and seconds add up; block efficiency
    is weighted by target calls, an acceptance recomputed from the sums."""
    out: dict = {}
    for key in parts[0]:
        values = [p.get(key) for p in parts]
        if key != "block_efficiency" and all(isinstance(v, int | float) for v in values):
            out[key] = sum(values)  # type: ignore[arg-type]
    if "target_calls" in out:
        calls = out.pop("target_calls")
        efficiency = sum((p["block_efficiency"] or 0.0) * p["target_calls"] for p in parts)
        out["block_efficiency"] = efficiency / calls if calls else None
    if out.get("drafted_tokens"):
        out["draft_acceptance"] = out["accepted_tokens"] / out["drafted_tokens"]
    else:
        out.pop("draft_acceptance", None)
    return out


def _lookup_run(
    binary: Path, target: Path | None, temperature: float, max_new: int, draft_max: int, texts: list[str],
    first_seed: int,
) -> dict:  # fmt: skip
    return run_llama_lookup(binary, target, texts, temperature, max_new, draft_max, first_seed=first_seed)


def with_rates(measured: dict) -> dict:
    """tokens_per_second: the whole requests' (prefill included); decode_tokens_per_second: the
    decode phase's, after each answer's first token (what speculation changes)."""
    out = dict(measured, tokens_per_second=measured["tokens"] / measured["seconds"])
    if measured.get("decode_seconds"):
        out["decode_tokens_per_second"] = measured["decode_tokens"] / measured["decode_seconds"]
    return out


def ratios(engine: dict, base: dict, base_name: str, engine_name: str = "default") -> dict:
    """engine over base, whole requests (`default_over_none`) and decode phase (`decode_...`)."""
    out = {f"{engine_name}_over_{base_name}": engine["tokens_per_second"] / base["tokens_per_second"]}
    if "decode_tokens_per_second" in engine and "decode_tokens_per_second" in base:
        decode = engine["decode_tokens_per_second"] / base["decode_tokens_per_second"]
        out[f"decode_{engine_name}_over_{base_name}"] = decode
    return out


def seed_runs(address: str, url: str, text: str, load_text: str, max_new: int, load_streams: int) -> dict:
    """A seeded T = 0.8 request with no speculation field, three times through gRPC and the HTTP
    completions API; the third time `load_streams` other streams run beside it."""
    import grpc

    pb2, pb2_grpc = load("gateway")
    texts: list[str] = []

    def grpc_text(seed: int, temperature: float, prompt: str) -> str:
        request = pb2.GenerateRequest(
            prompt=prompt, max_new_tokens=max_new, sampling=pb2.Sampling(temperature=temperature, seed=seed)
        )
        with grpc.insecure_channel(address) as channel:
            return pb2_grpc.GatewayStub(channel).Generate(request, timeout=600).text

    with urllib.request.urlopen(f"{url}/v1/models", timeout=60) as response:
        model = json.load(response)["data"][0]["id"]

    def http_text() -> str:
        body = json.dumps(
            {"model": model, "prompt": text, "max_tokens": max_new, "temperature": 0.8, "seed": 5}
        ).encode()
        request = urllib.request.Request(f"{url}/v1/completions", body, {"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as response:
            return json.load(response)["choices"][0]["text"]

    for run in range(3):
        others = []
        if run == 2:
            others = [
                threading.Thread(target=grpc_text, args=(100 + i, 1.0, load_text), daemon=True)
                for i in range(load_streams)
            ]
            for t in others:
                t.start()
            time.sleep(0.5)  # they are running when the measured request starts
        texts += [grpc_text(5, 0.8, text), http_text()]
        for t in others:
            t.join()
    return {"identical": len(set(texts)) == 1, "distinct_texts": len(set(texts)), "runs": len(texts)}


def bench_default(
    address: str,
    url: str,
    sets: tuple[str, ...] = PROMPT_SETS,
    prompts: int = 4,
    max_new: int = 64,
    temperatures: tuple[float, ...] = (0.0, 1.0),
    sessions: tuple[int, ...] = (1, 2, 4, 8),
    llama_server_binary: str | None = None,
    target: str = "default-target",
    lookup_draft_max: int = 4,
) -> dict:
    """llama_server_binary: also llama-server plain on `target`'s GGUF file, the same texts, and
    llama-lookup beside it (when it was built) on the copying sets."""
    from specmesh.runtime.tokenizers import gguf_file, load_tokenizer

    tokenizer, _ = load_tokenizer(gguf_file(target) or target)
    rows = []
    lookup_binary = find_llama_lookup(Path(llama_server_binary)) if llama_server_binary else None
    with contextlib.ExitStack() as stack:
        llama_url = None
        if llama_server_binary:
            llama_url = stack.enter_context(llama_server(Path(llama_server_binary), gguf_file(target)))
        for name in sets:
            texts = prompt_set(name, prompts, tokenizer)
            for temperature in temperatures:
                lookup: Engine | None = None
                if lookup_binary is not None and name in COPYING_SETS:
                    lookup = functools.partial(
                        _lookup_run, lookup_binary, gguf_file(target), temperature, max_new, lookup_draft_max
                    )
                measured = compare(address, texts, temperature, max_new, 1, llama_url, lookup=lookup)
                row = dict(set=name, temperature=temperature, sessions=1, **measured)
                rows.append(row)
                _print(row)
    # concurrent chat streams: the same max(sessions) texts at each concurrency, against
    # llama-server with as many slots (--parallel, its continuous batching)
    texts = prompt_set("chat", max(sessions), tokenizer)
    with contextlib.ExitStack() as stack:
        llama_url = None
        if llama_server_binary:
            llama_url = stack.enter_context(
                llama_server(Path(llama_server_binary), gguf_file(target), parallel=max(sessions))
            )
        for s in sessions:
            measured = compare(address, texts, 0.0, max_new, s, llama_url, max(sessions))
            row = dict(set="chat", temperature=0.0, sessions=s, concurrent=True, **measured)
            rows.append(row)
            _print(row)
    chat = prompt_set("chat", 1, tokenizer)[0]
    try:
        seeded = seed_runs(address, url, chat, chat, max_new, load_streams=4)
    except Exception as exc:  # reported, not lost with the rows above
        seeded = {"identical": None, "error": repr(exc)}
    print(
        f"seed 5, T=0.8, 3 runs x (gRPC, HTTP), 4 streams beside the third: identical={seeded['identical']}"
    )
    return dict(address=address, date=time.strftime("%Y-%m-%d %H:%M:%S"), rows=rows, seed=seeded)


def _print(row: dict) -> None:
    """A row's rates, whole requests then (in brackets) the decode phase."""
    d = row["default"]

    def rate(engine: dict) -> str:
        decode = engine.get("decode_tokens_per_second")
        return (
            f"{engine['tokens_per_second']:6.2f} ({decode:6.2f})"
            if decode
            else f"{engine['tokens_per_second']:6.2f}"
        )

    head = f"{row['set']:<7} T={row['temperature']:<3} sessions={row['sessions']}"
    rates = "".join(
        f"  {name} {rate(row[name])}"
        for name in ("llama_server", "llama_lookup", "none", "default")
        if name in row
    )
    vs = "".join(
        f"  x{row[k]:.2f} ({row.get('decode_' + k, float('nan')):.2f}) {k.removeprefix('default_over_')}"
        for k in ("default_over_none", "default_over_llama_server", "default_over_llama_lookup")
        if k in row
    )
    print(
        f"{head} tok/s{rates}\n    default{vs}  ({d['drafted_tokens']} drafted, "
        f"{d['accepted_tokens']} accepted, block efficiency {d['block_efficiency'] or 0:.2f})",
        flush=True,
    )
