"""What a model service's call costs against its bare forward: `specmesh bench calls`.

For M = 1, 2, 4, 8 rows it times, at the client, whole gRPC calls that each make ONE forward of M
rows: a Verify of one new token and a chain of M - 1 nodes (the verifier), and a Draft of M new
tokens at depth 1 (the drafter: the tokens' forward, then one child sampled from the last row).
Beside them: the service's own forward time (VerifyResponse.forward_seconds) and, with
`--llama-bench PATH`, llama.cpp's llama-bench on the same GGUF file (ms per forward of M rows,
`-p M -n 0`, as many threads as the service), the bare engine a CPU user would compare with.

    python -m verifier_service --port 50062 &  python -m drafter_service --port 50061 &
    specmesh bench calls --llama-bench ~/.cache/specmesh/llama-server/build/bin/llama-bench
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time

import grpc

from specmesh.core.ngram import chain_tree
from specmesh.rpc import wire
from specmesh.rpc.proto import pb2, pb2_grpc

ROWS = (1, 2, 4, 8)
PREFIX = 64  # tokens of context before the timed calls


def _tokens(n: int, start: int) -> list[int]:
    return [(start + 7919 * i) % 20000 + 1000 for i in range(n)]


def time_verifier(address: str, rows: int, calls: int) -> dict:
    """Median seconds of a Verify call of `rows` rows, at the client and on the model thread."""
    with grpc.insecure_channel(address) as channel:
        stub = pb2_grpc.VerifierStub(channel)
        vocab = stub.Info(pb2.InfoRequest()).vocab_size
        sid = f"bench-calls-v{rows}-{time.monotonic_ns()}"
        greedy = pb2.SamplingParams(temperature=0.0)
        reply = stub.Verify(
            pb2.VerifyRequest(session_id=sid, new_token_ids=_tokens(PREFIX, 1), sampling=greedy)
        )
        held, last = PREFIX, reply.next_token
        wall, forward = [], []
        try:
            for i in range(calls + 1):
                tree = chain_tree(_tokens(rows - 1, 10 * i), vocab)
                request = pb2.VerifyRequest(
                    session_id=sid, position=held, new_token_ids=[last], sampling=greedy
                )
                if tree is not None:
                    request.tree.CopyFrom(wire.tree_to_proto(tree))
                start = time.perf_counter()
                reply = stub.Verify(request)
                if i:  # the first call warms up
                    wall.append(time.perf_counter() - start)
                    forward.append(reply.forward_seconds)
                held += 1 + len(reply.accepted_token_ids)
                last = reply.next_token
        finally:
            stub.Release(pb2.ReleaseRequest(session_id=sid))
    return {"call_ms": 1000 * statistics.median(wall), "forward_ms": 1000 * statistics.median(forward)}


def time_drafter(address: str, rows: int, calls: int) -> dict:
    """Median seconds of a Draft call that feeds `rows` new tokens at depth 1, at the client and
    as the drafter reports it."""
    with grpc.insecure_channel(address) as channel:
        stub = pb2_grpc.DrafterStub(channel)
        sid = f"bench-calls-d{rows}-{time.monotonic_ns()}"
        greedy = pb2.SamplingParams(temperature=0.0)
        spec = pb2.TreeSpec(method="chain", depth=1)
        stub.Draft(
            pb2.DraftRequest(
                session_id=sid, new_token_ids=_tokens(PREFIX, 1), sampling=greedy, tree_spec=spec
            )
        )
        held, wall, inside = PREFIX, [], []
        try:
            for i in range(calls + 1):
                request = pb2.DraftRequest(
                    session_id=sid,
                    position=held,
                    new_token_ids=_tokens(rows, 10 * i),
                    sampling=greedy,
                    tree_spec=spec,
                )
                start = time.perf_counter()
                reply = stub.Draft(request)
                if i:
                    wall.append(time.perf_counter() - start)
                    inside.append(reply.draft_seconds)
                held += rows
        finally:
            stub.Release(pb2.ReleaseRequest(session_id=sid))
    return {"call_ms": 1000 * statistics.median(wall), "service_ms": 1000 * statistics.median(inside)}


def llama_bench(binary: str, gguf: str, threads: int, rows: tuple[int, ...] = ROWS) -> dict[int, float]:
    """ms per forward of M rows from llama-bench (`-p M -n 0`), by M."""
    out = subprocess.run(
        [binary, "-m", gguf, "-p", ",".join(map(str, rows)), "-n", "0", "-t", str(threads), "-o", "json"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return {int(r["n_prompt"]): r["avg_ns"] / 1e6 for r in json.loads(out)}


def bench_calls(
    verifier: str, drafter: str, calls: int = 20, bench_binary: str | None = None, threads: int = 0
) -> dict:
    infos = {}
    for role, address, stub_cls in (
        ("verifier", verifier, pb2_grpc.VerifierStub),
        ("drafter", drafter, pb2_grpc.DrafterStub),
    ):
        with grpc.insecure_channel(address) as channel:
            infos[role] = stub_cls(channel).Info(pb2.InfoRequest()).model_id
    threads = threads or os.cpu_count() or 1
    rows_out = []
    for role, timer in (("verifier", time_verifier), ("drafter", time_drafter)):
        bare = llama_bench(bench_binary, infos[role], threads) if bench_binary else {}
        for m in ROWS:
            row = {"role": role, "rows": m, **timer(verifier if role == "verifier" else drafter, m, calls)}
            if m in bare:
                row["llama_bench_ms"] = bare[m]
                row["call_over_bench"] = row["call_ms"] / bare[m]
            rows_out.append(row)
            ratio = f"  x{row['call_over_bench']:.2f} of llama-bench ({bare[m]:.1f} ms)" if m in bare else ""
            inside = row.get("forward_ms", row.get("service_ms"))
            print(
                f"{role:<8} {m} rows: call {row['call_ms']:6.1f} ms  in the service {inside:6.1f} ms{ratio}",
                flush=True,
            )
    return {"models": infos, "threads": threads, "rows": rows_out, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
