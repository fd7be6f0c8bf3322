"""`specmesh bench conversation`: long prompts and whole conversations, the stack against
llama.cpp's `llama-server` with its prompt cache on, the same GGUF, through the same OpenAI API.

    specmesh bench conversation --llama-server PATH --json docs/benchmarks/conversation.json

It starts what it measures itself: the stack as `specmesh up` starts it (a drafter, an n-gram
drafter, a verifier, the gateway; no flags), and for each phase a fresh llama-server (`-c 8192`
per slot, the slots the phase needs) beside it; one engine's requests run at a time.

  turns     conversations of 6 turns: a system prompt of ~1.5k tokens (a module's documentation,
            pydoc's, from this Python), then six short questions, 48 tokens an answer at most,
            greedy, each turn sending the conversation so far; the engines take turns, turn by
            turn, so that a machine whose speed drifts weighs on both alike; `--repeats`
            conversations (the questions rotated), per turn the median time to first token
  parallel  the same, 4 conversations at once (each its own order of the questions)
  long      one ~4k-token prompt (more of the documentation): its time to first token, no error
  hol       head of line: one stream decodes; 4 s later a ~1.3k-token prompt arrives. The running
            stream's longest gap between chunks while it waits, the long prompt's time to first
            token, and that prompt's prefill alone (the same length, the engine idle)
  routing   `specmesh up --verifiers 2 --drafters 2` with two gateways: 8 conversations of 6 turns,
            turn k of conversation c sent to gateway (c + k) % 2; how often turns 2-6 started from
            the previous turn's whole prompt (their usage's cached_tokens at least its prompt
            tokens: the system prompt, which every replica holds, is not a hit), the verifiers'
            prefix-cache hit rate over turns 2-6 (their metrics) and the gateways' failovers, with
            routing by cached prefix on and off (--no-prefix-routing)

Every specmesh request carries a `cache_salt` of its run, so that no run starts from another's
prefixes; llama-server is started afresh for every phase.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import pydoc
import secrets
import statistics
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specmesh.bench.anchors import llama_server
from specmesh.stack.supervisor import Supervisor, plan_stack

PHASES = ("turns", "parallel", "long", "hol", "routing")
QUESTIONS = (
    "In one sentence: what does json.dumps return?",
    "Which argument of json.dumps sorts the keys of the output?",
    "How do I write JSON to an open file instead of to a string?",
    "What does the indent argument do?",
    "Which exception does json.loads raise on invalid input?",
    "How can I make json.dumps handle a type it does not know, such as a datetime?",
)
ANSWER_TOKENS = 48
SYSTEM_TOKENS, LONG_TOKENS, HOL_TOKENS = 1500, 4000, 1300
HOL_DELAY = 4.0  # seconds between the running stream's start and the long prompt's


# ---- prompts ------------------------------------------------------------------------------------


def documentation() -> str:
    """pydoc's documentation of the json package: the same text wherever this Python runs."""
    import json

    return pydoc.plain(pydoc.render_doc(json, renderer=pydoc.plaintext))


def cut_to_tokens(text: str, tokens: int, count: Callable[[str], int]) -> str:
    """The longest run of `text`'s first lines that counts at most `tokens` tokens."""
    lines = text.splitlines(keepends=True)
    lo, hi = 1, len(lines)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count("".join(lines[:mid])) <= tokens:
            lo = mid
        else:
            hi = mid - 1
    return "".join(lines[:lo])


def system_prompt(text: str) -> str:
    return "You answer questions about this Python module's documentation, briefly.\n\n" + text


# ---- one engine's requests -----------------------------------------------------------------------


@dataclass
class Turn:
    ttft: float  # seconds to the first content
    seconds: float  # the whole request
    prompt_tokens: int = 0
    cached_tokens: int = 0  # as the engine reports it (0: it does not)
    completion_tokens: int = 0
    gaps: list[tuple[float, float]] = field(default_factory=list)  # (when, seconds since the chunk before)
    text: str = ""
    start: float = 0.0  # perf_counter when it was sent


@dataclass(frozen=True)
class Engine:
    name: str
    base_url: str  # ".../v1"
    model: str
    salt: str = ""  # specmesh: this run's cache_salt ("": none, llama-server)

    def chat(
        self, messages: list[dict], max_tokens: int = ANSWER_TOKENS, stop: threading.Event | None = None
    ) -> Turn:
        """One streamed chat completion, greedy; stop: ends the stream early once set."""
        from openai import OpenAI

        client = OpenAI(base_url=self.base_url, api_key="none", timeout=3600, max_retries=0)
        extra = {"cache_salt": self.salt} if self.salt else None
        start = last = time.perf_counter()
        turn = Turn(ttft=0.0, seconds=0.0, start=start)
        text = []
        stream = client.chat.completions.create(
            model=self.model, messages=messages, max_tokens=max_tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body=extra,
        )  # fmt: skip
        with contextlib.closing(stream):
            for chunk in stream:
                now = time.perf_counter()
                if chunk.choices and chunk.choices[0].delta.content:
                    if not text:
                        turn.ttft = now - start
                    else:
                        turn.gaps.append((now, now - last))
                    text.append(chunk.choices[0].delta.content)
                    last = now
                if chunk.usage is not None:
                    turn.prompt_tokens = chunk.usage.prompt_tokens
                    turn.completion_tokens = chunk.usage.completion_tokens
                    details = getattr(chunk.usage, "prompt_tokens_details", None)
                    turn.cached_tokens = int(getattr(details, "cached_tokens", 0) or 0) if details else 0
                if stop is not None and stop.is_set():
                    break
        turn.seconds, turn.text = time.perf_counter() - start, "".join(text)
        return turn


def conversations(
    engine: Engine, system: str, n: int, route: Callable[[int, int], Engine] | None = None
) -> list[list[Turn]]:
    """n conversations at once, conversation c asking the questions rotated by c; route(c, k): the
    engine of conversation c's turn k (default: `engine`)."""

    def one(c: int) -> list[Turn]:
        messages = [{"role": "system", "content": system}]
        return converse(messages, rotated(c), lambda k: route(c, k) if route else engine)

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def rotated(c: int) -> tuple[str, ...]:
    """Conversation c's questions: QUESTIONS rotated by c."""
    return QUESTIONS[c % len(QUESTIONS) :] + QUESTIONS[: c % len(QUESTIONS)]


def converse(
    messages: list[dict], questions: Sequence[str], engine: Callable[[int], Engine], first: int = 0
) -> list[Turn]:
    """Ask `questions` in turn after `messages` (which grows by each question and its answer);
    engine(k): the engine of turn k, counted from `first`."""
    turns = []
    for k, question in enumerate(questions, start=first):
        messages.append({"role": "user", "content": question})
        turn = engine(k).chat(messages)
        turns.append(turn)
        messages.append({"role": "assistant", "content": turn.text})
    return turns


def head_of_line(engine: Engine, long_text: str, alone_text: str) -> dict:
    """A stream decodes; HOL_DELAY later a long prompt arrives (module docstring)."""
    stop = threading.Event()
    streamed: dict[str, Any] = {}

    def running() -> None:
        messages = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
        try:  # 1000: within the gateway's default --max-new-tokens-limit
            streamed["turn"] = engine.chat(messages, max_tokens=1000, stop=stop)
        except Exception as exc:
            streamed["error"] = exc

    thread = threading.Thread(target=running)
    thread.start()
    time.sleep(HOL_DELAY)
    long_turn = engine.chat([{"role": "user", "content": long_text + "\n\nSummarise this in one line."}], 8)
    time.sleep(2.0)  # the stream goes on a little after the long prompt's first token
    stop.set()
    thread.join()
    if "error" in streamed:
        raise streamed["error"]
    stream = streamed["turn"]
    window = (long_turn.start, long_turn.start + long_turn.ttft + 2.0)
    long_gaps = [
        [round(when - window[0], 2), round(g, 2)] for when, g in stream.gaps if g > 1.0 and window[0] <= when
    ]
    gaps = [g for when, g in stream.gaps if window[0] <= when <= window[1] + 60]
    before = [g for when, g in stream.gaps if when < window[0]]
    alone = engine.chat([{"role": "user", "content": alone_text + "\n\nSummarise this in one line."}], 8)
    return {
        "longest_gap_seconds": round(max(gaps, default=0.0), 3),
        "typical_gap_seconds": round(sorted(before)[len(before) // 2], 3) if before else None,
        "long_prompt_tokens": long_turn.prompt_tokens,
        "long_ttft_seconds": round(long_turn.ttft, 3),
        "alone_ttft_seconds": round(alone.ttft, 3),
        "ttft_over_alone": round(long_turn.ttft / alone.ttft, 3) if alone.ttft else None,
        "stream_tokens_before_stop": len(stream.gaps) + 1,
        # the stream's gaps of over a second, at their time from the long prompt's start: where they fall
        "long_gaps": long_gaps,
    }


# ---- the engines' runs -------------------------------------------------------------------------


def _turns_summary(turns: list[Turn]) -> dict:
    return {
        "ttft_seconds": [round(t.ttft, 3) for t in turns],
        "seconds": [round(t.seconds, 3) for t in turns],
        "prompt_tokens": [t.prompt_tokens for t in turns],
        "cached_tokens": [t.cached_tokens for t in turns],
        "completion_tokens": [t.completion_tokens for t in turns],
        "total_seconds": round(sum(t.seconds for t in turns), 3),
    }


def _run_phase(engine: Engine, phase: str, texts: dict[str, str]) -> dict:
    """One engine's phase (not `turns`, which `run_phase` interleaves)."""
    phases = (phase,)
    out: dict[str, Any] = {}
    if "parallel" in phases:
        start = time.perf_counter()
        runs = conversations(engine, texts["system"], 4)
        out["parallel"] = {
            "wall_seconds": round(time.perf_counter() - start, 3),
            "conversations": [_turns_summary(t) for t in runs],
        }
    if "long" in phases:
        try:
            turn = engine.chat(
                [{"role": "user", "content": texts["long"] + "\n\nSummarise this in one line."}], 16
            )
            out["long"] = {"prompt_tokens": turn.prompt_tokens, "ttft_seconds": round(turn.ttft, 3),
                           "seconds": round(turn.seconds, 3), "error": None}  # fmt: skip
        except Exception as exc:  # the point of the phase: does it answer at all
            out["long"] = {"error": f"{type(exc).__name__}: {exc}"}
    if "hol" in phases:
        out["hol"] = head_of_line(engine, texts["hol"], texts["hol_alone"])
    return out


@contextlib.contextmanager
def specmesh_stack(**plan: Any) -> Iterator[Any]:
    """The stack `specmesh up` starts (its defaults, `plan` overriding them), in a thread of its
    own; yields the StackPlan once every child is ready. Its children's output goes to a file
    whose end a failed start says."""
    import tempfile

    gateways = plan.get("gateways", 1)
    stack = plan_stack(**{"ngram_drafters": 1, "http_port": _free_ports(gateways), **plan})
    log = tempfile.NamedTemporaryFile("w+", prefix="specmesh-bench-stack-", suffix=".log")  # noqa: SIM115
    loop = asyncio.new_event_loop()
    supervisor = Supervisor(stack.specs, output=log)
    started = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(supervisor.start())
        except BaseException as exc:
            failure.append(exc)
            loop.run_until_complete(supervisor.stop())  # the children already started
        started.set()
        if not failure:
            loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    started.wait()
    try:
        if failure:
            log.flush()
            tail = Path(log.name).read_text(errors="replace")[-3000:]
            raise RuntimeError(f"the stack did not start: {failure[0]!r}; its output ended:\n{tail}")
        yield stack
    finally:
        if not failure:
            asyncio.run_coroutine_threadsafe(supervisor.stop(), loop).result(timeout=120)
            loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        stack.cleanup()
        log.close()


def _free_ports(n: int) -> int:
    """The first of n consecutive free ports (the gateways' HTTP ports: gateway i on port + i),
    taken from this process's walk (`free_port`), so that no replica's port is picked among them."""
    from specmesh.stack.ports import free_port

    while True:
        first = free_port()
        if all(free_port() == first + i for i in range(1, n)):
            return first


def _model_id(base_url: str) -> str:
    import json

    with urllib.request.urlopen(f"{base_url}/models", timeout=30) as reply:
        return json.loads(reply.read())["data"][0]["id"]


def _prefill_chunks(stack: Any) -> dict[str, int]:
    """The first gateway's chunk per role (`--prefill-chunk auto` follows the replicas' start-up
    measurement: a result says what it ran with)."""
    samples = _samples(stack.http)
    return {s.labels["role"]: int(s.value) for s in samples if s.name == "specmesh:prefill_chunk_tokens"}


def _samples(address: str) -> list[Any]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def _metrics(address: str) -> dict[str, float]:
    """Each sample name's sum over its labels."""
    out: dict[str, float] = {}
    for s in _samples(address):
        out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def routing_run(target: str, draft: str, routing: bool, system: str) -> dict:
    """8 conversations over two gateways on two verifiers and two drafters (module docstring)."""
    flags = [] if routing else ["--no-prefix-routing"]
    with specmesh_stack(
        target=target, draft=draft, verifiers=2, drafters=2, gateways=2, gateway_args=flags
    ) as stack:
        urls = [f"http://{http}/v1" for _, http in stack.gateways]
        salt = secrets.token_hex(8)
        engines = [Engine(f"gateway-{i}", url, _model_id(url), salt) for i, url in enumerate(urls)]
        verifiers = [a for name, a in stack.metrics.items() if name.startswith("verifier")]
        # turn 1 of every conversation first: the hit rate is measured over turns 2-6
        first_turns = [rotated(c)[0] for c in range(8)]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            firsts = list(pool.map(lambda c: engines[c % 2].chat(
                [{"role": "system", "content": system}, {"role": "user", "content": first_turns[c]}]
            ), range(8)))  # fmt: skip
        before = [_metrics(a) for a in verifiers]

        def rest(c: int) -> list[Turn]:
            questions = rotated(c)
            messages = [{"role": "system", "content": system}, {"role": "user", "content": questions[0]},
                        {"role": "assistant", "content": firsts[c].text}]  # fmt: skip
            return converse(messages, questions[1:], lambda k: engines[(c + k) % 2], first=1)

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            later = list(pool.map(rest, range(8)))
        after = [_metrics(a) for a in verifiers]
        gateways = [a for name, a in stack.metrics.items() if name.startswith("gateway")]
        failovers = sum(_metrics(a).get("specmesh:failovers_total", 0.0) for a in gateways)
        chunks = _prefill_chunks(stack)

    def grown(name: str) -> float:
        return sum(a.get(name, 0.0) - b.get(name, 0.0) for a, b in zip(after, before, strict=True))

    queries, hits = grown("specmesh:prefix_cache_queries_total"), grown("specmesh:prefix_cache_hits_total")
    # a turn hit its history when it started from all the previous turn's prompt (and so its
    # answer): the system prompt that every conversation shares is not enough
    previous = {c: [firsts[c], *later[c][:-1]] for c in range(8)}
    pairs = [(turn, prev) for c in range(8) for turn, prev in zip(later[c], previous[c], strict=True)]
    hit = sum(1 for turn, prev in pairs if turn.cached_tokens >= prev.prompt_tokens)
    total = sum(len(t) for t in later)
    return {
        "prefix_routing": routing,
        "turns_2_6": total,
        "turns_that_hit_their_history": hit,
        "hit_share": round(hit / total, 3),
        "verifier_token_hit_rate": round(hits / queries, 3) if queries else None,
        "failovers": int(failovers),  # the gateways', over the whole run: sessions moved off a replica
        "prefill_chunk": chunks,
        "ttft_seconds_turns_2_6": sorted(round(t.ttft, 3) for turns in later for t in turns),
        # per turn 2-6, conversation by conversation: its prompt, what it took from a cache, the
        # previous turn's prompt
        "turns": [[turn.prompt_tokens, turn.cached_tokens, prev.prompt_tokens] for turn, prev in pairs],
    }


def bench_conversation(
    phases: Sequence[str] = PHASES,
    llama_server_binary: str | None = None,
    target: str = "default-target",
    draft: str = "default-draft",
    repeats: int = 3,
    on_phase: Callable[[dict], object] = lambda result: None,
) -> dict:
    """Every phase asked (module docstring): the stack and llama-server both up, the engines'
    requests in turn (the `turns` phase: turn by turn, the first engine alternating, `repeats`
    conversations with the questions rotated), so that a machine whose speed drifts weighs on
    both alike. on_phase(result so far): after each phase (a later phase's failure loses none)."""
    from specmesh.runtime.tokenizers import gguf_file, load_tokenizer

    tokenizer, _ = load_tokenizer(gguf_file(target) or target)

    def count(text: str) -> int:
        return len(tokenizer(text)["input_ids"])

    doc = documentation()
    texts = {
        "system": system_prompt(cut_to_tokens(doc, SYSTEM_TOKENS, count)),
        "long": cut_to_tokens(doc, LONG_TOKENS, count),
        "hol": cut_to_tokens(doc, HOL_TOKENS, count),
        "hol_alone": cut_to_tokens(doc[len(doc) // 2 :], HOL_TOKENS, count),  # the same length, other text
    }
    result: dict[str, Any] = {
        "phases": list(phases),
        "system_tokens": count(texts["system"]),
        "repeats": repeats,
    }
    local = [p for p in phases if p != "routing"]
    if local:
        result["specmesh"], result["llama_server"] = {}, {}
        with specmesh_stack(target=target, draft=draft) as stack:
            url = f"http://{stack.http}/v1"
            ours = Engine("specmesh", url, _model_id(url), secrets.token_hex(8))
            result["prefill_chunk"] = _prefill_chunks(stack)
            for phase in local:  # a fresh llama-server each phase: nothing cached from the one before
                ours_now = dataclasses.replace(ours, salt=f"{ours.salt}-{phase}")
                with _llama(llama_server_binary, gguf_file(target), phase) as theirs:
                    engines = [e for e in (ours_now, theirs) if e is not None]
                    for name, measured in run_phase(engines, phase, texts, repeats).items():
                        result[name].update(measured)
                result["ratios"] = _ratios(result)
                on_phase(result)
    if "routing" in phases:
        result["routing"] = []
        for on in (True, False):
            result["routing"].append(routing_run(target, draft, on, texts["system"]))
            on_phase(result)
    return result


@contextlib.contextmanager
def _llama(binary: str | None, gguf: Any, phase: str) -> Iterator[Engine | None]:
    if not binary:
        yield None
        return
    slots = {"parallel": 4, "hol": 2}.get(phase, 1)
    with llama_server(Path(binary), gguf, parallel=slots, context=8192) as base:
        yield Engine("llama_server", f"{base}/v1", _model_id(f"{base}/v1"))


def run_phase(engines: Sequence[Engine], phase: str, texts: dict[str, str], repeats: int) -> dict:
    """One phase on every engine -> {engine name: {phase: what it measured}}."""
    if phase == "turns":  # interleaved turn by turn
        runs: dict[str, list[list[Turn]]] = {e.name: [] for e in engines}
        for r in range(repeats):
            questions = QUESTIONS[r:] + QUESTIONS[:r]
            histories = {e.name: [{"role": "system", "content": texts["system"]}] for e in engines}
            turns: dict[str, list[Turn]] = {e.name: [] for e in engines}
            for k, question in enumerate(questions):
                order = engines if (r + k) % 2 == 0 else list(reversed(engines))
                for e in order:
                    messages = histories[e.name]
                    messages.append({"role": "user", "content": question})
                    turn = e.chat(messages)
                    turns[e.name].append(turn)
                    messages.append({"role": "assistant", "content": turn.text})
            for name, t in turns.items():
                runs[name].append(t)
        return {name: {"turns": _repeats_summary(r)} for name, r in runs.items()}
    return {e.name: _run_phase(e, phase, texts) for e in engines}


def _repeats_summary(runs: list[list[Turn]]) -> dict:
    """Per turn, the median over the repeated conversations; and each conversation's."""
    per_turn = list(zip(*runs, strict=True))
    return {
        "ttft_seconds": [round(statistics.median(t.ttft for t in turns), 3) for turns in per_turn],
        "total_seconds": round(statistics.median(sum(t.seconds for t in run) for run in runs), 3),
        "conversations": [_turns_summary(run) for run in runs],
    }


def _ratios(result: dict) -> dict:
    """specmesh over llama-server, where both ran: turns 2-6's time to first token, each, and the
    whole conversation's time."""
    ours, theirs = result.get("specmesh", {}), result.get("llama_server", {})
    out: dict[str, Any] = {}
    if "turns" in ours and "turns" in theirs:
        a, b = ours["turns"], theirs["turns"]
        out["turns_2_6_ttft"] = [
            round(x / y, 3) for x, y in zip(a["ttft_seconds"][1:], b["ttft_seconds"][1:], strict=True)
        ]
        out["conversation_seconds"] = round(a["total_seconds"] / b["total_seconds"], 3)
        # greedy answers may differ in length between engines (numerics): whole conversations
        # compared where each turn's answer has the same length, and decoding per token
        same = [
            (x["total_seconds"], y["total_seconds"])
            for x, y in zip(a["conversations"], b["conversations"], strict=True)
            if x["completion_tokens"] == y["completion_tokens"]
        ]
        if same:
            out["conversation_seconds_same_answers"] = round(
                sum(x for x, _ in same) / sum(y for _, y in same), 3
            )
        out["decode_seconds_per_token"] = round(_per_token(a) / _per_token(b), 3)
    if "parallel" in ours and "parallel" in theirs:
        a, b = ours["parallel"], theirs["parallel"]
        ttft = lambda runs: [t for r in runs["conversations"] for t in r["ttft_seconds"][1:]]  # noqa: E731
        out["parallel_turns_2_6_ttft_mean"] = round(sum(ttft(a)) / sum(ttft(b)), 3)
        out["parallel_wall_seconds"] = round(a["wall_seconds"] / b["wall_seconds"], 3)
    if "hol" in ours and "hol" in theirs:
        out["hol_longest_gap"] = round(
            ours["hol"]["longest_gap_seconds"] / theirs["hol"]["longest_gap_seconds"], 3
        )
    return out


def _per_token(turns: dict) -> float:
    """Seconds a decoded token took after each answer's first, over the conversations."""
    seconds = tokens = 0.0
    for run in turns["conversations"]:
        for total, ttft, n in zip(run["seconds"], run["ttft_seconds"], run["completion_tokens"], strict=True):
            seconds, tokens = seconds + total - ttft, tokens + max(0, n - 1)
    return seconds / tokens if tokens else 0.0


def markdown(result: dict) -> str:
    """A few tables of what ran."""
    lines = [f"System prompt: {result.get('system_tokens')} tokens.", ""]
    for name in ("specmesh", "llama_server"):
        turns = result.get(name, {}).get("turns")
        if turns:
            ttft = ", ".join(f"{t:.2f}" for t in turns["ttft_seconds"])
            lines.append(f"- {name}: TTFT per turn {ttft} s; conversation {turns['total_seconds']:.1f} s")
    for name in ("specmesh", "llama_server"):
        got = result.get(name, {})
        if "parallel" in got:
            lines.append(f"- {name}, 4 conversations at once: {got['parallel']['wall_seconds']:.1f} s")
        if "long" in got:
            long = got["long"]
            said = long["error"] or f"{long['prompt_tokens']} tokens, TTFT {long['ttft_seconds']:.1f} s"
            lines.append(f"- {name}, long prompt: {said}")
        if "hol" in got:
            hol = got["hol"]
            lines.append(
                f"- {name}, head of line: longest gap {hol['longest_gap_seconds']:.2f} s (typical "
                f"{hol['typical_gap_seconds']} s); the long prompt's TTFT {hol['long_ttft_seconds']:.1f} s, "
                f"alone {hol['alone_ttft_seconds']:.1f} s ({hol['ttft_over_alone']}x)"
            )
    if result.get("ratios"):
        lines.append(f"- ratios (specmesh / llama-server): {result['ratios']}")
    for run in result.get("routing", []):
        lines.append(
            f"- routing {'on' if run['prefix_routing'] else 'off'}: turns 2-6 that hit their history "
            f"{run['turns_that_hit_their_history']}/{run['turns_2_6']}, verifier token hit rate "
            f"{run['verifier_token_hit_rate']}"
        )
    return "\n".join(lines)
