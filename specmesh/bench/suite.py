"""`specmesh bench report`: every comparison of the benchmark issue in one run, on the real pair.

Phases (each can be re-run alone with --phases; its rows replace the old ones in results.json):
  sweeps     in-process engine: RSD Exp1 (fixed depth), Exp2 (fixed node budget), MCSD's k table,
             MTAD vs chain with perplexity under the target; one autoregressive row per
             temperature is the reference for their speedups
  baselines  transformers: plain `generate` and `generate(assistant_model=...)` (assisted)
  gateway    a stack started by this command (`specmesh up --no-demo`): autoregressive, fixed
             shapes and the adaptive mode through the public API, for each draft dtype
  scaling    1, 2, 4, 8 concurrent streams through the gateway: aggregate tokens/s, per-token
             latency, time to first token
  default    what `specmesh up` gives a user with no tuning against what they would run instead,
             on two prompt sets (code: HumanEval; chat: instruction questions rendered with the
             chat template): llama.cpp's llama-server on the same GGUF pair, plain and with its
             draft-model speculation (bench/anchors.py; skipped without a binary), transformers
             plain and assisted, the stack started with no flags and requests with no
             speculation field ("specmesh default"), and the same stack with `none` and fixed
             shapes (the best fixed shape in hindsight); then the default against `none` at
             1, 2, 4, 8 concurrent streams
Every speedup is a ratio of two rows measured in the same invocation (the VM's speed drifts
between runs); the goals compare the gateway with transformers, so re-run `baselines` and
`gateway` together.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import math
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specmesh.bench.anchors import find_llama_server, llama_server, run_llama_server
from specmesh.bench.measure import (
    PROMPT_SETS,
    humaneval_prompts,
    prompt_set,
    run_engine,
    run_gateway,
    stats_fields,
)
from specmesh.bench.progress import Progress
from specmesh.bench.report import write_report
from specmesh.core.drafting import TreeSpec
from specmesh.core.methods import Method
from specmesh.core.sampling import SamplingParams
from specmesh.stack.ports import free_port

PHASES = ("sweeps", "baselines", "gateway", "scaling", "default")
AR = TreeSpec(Method.NONE)


@dataclass
class SuiteConfig:
    draft: str = "default-draft"
    target: str = "default-target"
    dtype: str = "bf16"  # the target's, always
    draft_dtypes: tuple[str, ...] = ("int8", "bf16")  # gateway phase; sweeps use the first
    prompts: int = 6  # headline: baselines and gateway
    max_new_tokens: int = 96
    sweep_prompts: int = 2
    sweep_max_new_tokens: int = 64
    scaling: tuple[int, ...] = (1, 2, 4, 8)
    scaling_max_new_tokens: int = 64
    temperatures: tuple[float, ...] = (0.0, 1.0)
    phases: tuple[str, ...] = PHASES
    out: Path = Path("docs/benchmarks")
    llama_server: str | None = None  # the binary; default: bench/anchors.py's find_llama_server
    headline: dict[str, tuple[TreeSpec, bool]] = field(default_factory=lambda: dict(HEADLINE))


# label -> (tree, adaptive); the adaptive rows give the family and the first round's depth
HEADLINE = {
    "chain L=4": (TreeSpec("chain", depth=4), False),
    "rsd_s 2x4": (TreeSpec("rsd_s", depth=4, beam_width=2), False),
    "rsd_s 3x4": (TreeSpec("rsd_s", depth=4, beam_width=3), False),
    "adaptive chain": (TreeSpec("chain", depth=4), True),
}
SECOND_DTYPE = ("chain L=4", "adaptive chain")  # what the other draft dtypes' stacks run
SCALING = ("autoregressive", "chain L=4", "adaptive chain")


# ---- the papers' shapes ------------------------------------------------------------------------


def _dashes(branching: Sequence[int]) -> str:
    return "-".join(str(b) for b in branching)


def exp1_specs(depth: int) -> list[tuple[str, TreeSpec]]:
    """RSD paper 001 App. C.3.1 at draft length L: K×L for K independent sequences (here MCSD's
    [K,1,…,1] tree, i.i.d. and without replacement: K-SEQ is not implemented) and RSD-S beams."""
    k_small, k_large = {2: (2, 3), 3: (3, 4), 4: (5, 7), 5: (6, 12)}[depth]
    seq = (k_small,) + (1,) * (depth - 1)
    return [
        (f"chain L={depth}", TreeSpec("chain", depth=depth)),
        (f"mcsd iid {_dashes(seq)}", TreeSpec("mcsd", depth=depth, branching=seq, replacement=True)),
        (f"mcsd wor {_dashes(seq)}", TreeSpec("mcsd", depth=depth, branching=seq)),
        (f"rsd_c {_dashes((2,) * depth)}", TreeSpec("rsd_c", depth=depth, branching=(2,) * depth)),
        (f"rsd_s {k_small}x{depth}", TreeSpec("rsd_s", depth=depth, beam_width=k_small)),
        (f"rsd_s {k_large}x{depth}", TreeSpec("rsd_s", depth=depth, beam_width=k_large)),
    ]


EXP1_DEPTHS = (2, 3, 4, 5)

# App. C.3.2: budget -> RSD-S (beam, depth) shapes and the first RSD-C shape; SD drafts B tokens.
EXP2 = {
    6: ([(2, 3), (3, 2)], (2, 1, 1)),
    10: ([(2, 5), (5, 2)], (2, 1, 1, 1, 1)),
    14: ([(2, 7), (7, 2)], (2, 1, 1, 1, 1, 1, 1)),
    21: ([(3, 7), (7, 3)], (3, 1, 1, 1, 1, 1, 1)),
    30: ([(5, 6), (6, 5)], (2, 2, 2, 2)),
}


def exp2_specs(budget: int) -> list[tuple[str, TreeSpec]]:
    beams, rsd_c = EXP2[budget]
    out = [(f"chain L={budget}", TreeSpec("chain", depth=budget))]
    out += [(f"rsd_s {w}x{d}", TreeSpec("rsd_s", depth=d, beam_width=w)) for w, d in beams]
    out.append((f"rsd_c {_dashes(rsd_c)}", TreeSpec("rsd_c", depth=len(rsd_c), branching=rsd_c)))
    return out


def mcsd_specs() -> list[tuple[str, int, TreeSpec]]:
    """MCSD paper 004: k = 1 vs k = 4 candidates per step (depth 2), then k-configs with at most
    32 leaves (their Tables 1–3 search space), without replacement."""
    out = [
        ("mcsd k=1 1-1", 1, TreeSpec("mcsd", depth=2, branching=(1, 1), replacement=True)),
        ("mcsd iid k=4 4-4", 4, TreeSpec("mcsd", depth=2, branching=(4, 4), replacement=True)),
        ("mcsd wor k=4 4-4", 4, TreeSpec("mcsd", depth=2, branching=(4, 4))),
    ]
    for config in ((2, 2, 1), (4, 2, 1), (4, 2, 2), (8, 2, 1)):
        out.append((f"mcsd wor {_dashes(config)}", config[0], TreeSpec("mcsd", depth=3, branching=config)))
    return out


MTAD = [
    ("mtad 3x3", TreeSpec("mtad", depth=3, beam_width=3)),
    ("mtad 3x4", TreeSpec("mtad", depth=4, beam_width=3)),
    ("chain L=3", TreeSpec("chain", depth=3)),
    ("chain L=4", TreeSpec("chain", depth=4)),
]


# ---- measuring ---------------------------------------------------------------------------------


def _row(experiment: str, label: str, temperature: float, **values) -> dict:
    row = dict(
        experiment=experiment, label=label, temperature=temperature, date=time.strftime("%Y-%m-%d %H:%M")
    )
    row.update(values)
    if row.get("seconds"):
        row["tokens_per_second"] = row["tokens"] / row["seconds"]
    return row


def _spec_fields(spec: TreeSpec) -> dict:
    return dict(method=spec.method, depth=spec.depth, nodes=spec.max_nodes)


@torch.inference_mode()
def perplexity(model, prompts: list[list[int]], outputs: list[list[int]]) -> float:
    """exp(mean negative log-likelihood of the generated tokens under `model`)."""
    nll, count = 0.0, 0
    for prompt, out in zip(prompts, outputs, strict=True):
        ids = torch.tensor([prompt + out], device=model.device)
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
        logp = torch.log_softmax(logits, dim=-1)
        nll -= logp.gather(1, torch.tensor(out, device=model.device)[:, None]).sum().item()
        count += len(out)
    return math.exp(nll / count)


def sweeps(cfg: SuiteConfig, draft, target, texts: list[str]) -> list[dict]:
    from specmesh.runtime.engine import SpeculativeEngine

    engine = SpeculativeEngine(draft, target)
    prompts = [target.tokenizer(t)["input_ids"] for t in texts[: cfg.sweep_prompts]]
    max_new = cfg.sweep_max_new_tokens
    engine.generate(prompts[0], TreeSpec("chain", depth=2), SamplingParams(0.0), 4)  # warm-up
    rows = []
    for t in cfg.temperatures:
        tokens, seconds, stats, outputs = run_engine(engine, prompts, AR, t, max_new)
        ar_rate = tokens / seconds
        ppl = perplexity(target.model, prompts, outputs)
        ar = dict(tokens=tokens, seconds=seconds, via="engine", speedup=1.0, **_spec_fields(AR))
        for experiment in ("exp1", "exp2", "mtad"):
            rows.append(_row(experiment, "autoregressive", t, **ar, perplexity=ppl, **stats_fields(stats)))
        _log(rows[-1])

        def measure(experiment: str, label: str, spec: TreeSpec, with_ppl: bool = False, **extra) -> None:
            tokens, seconds, stats, outputs = run_engine(engine, prompts, spec, t, max_new)  # noqa: B023
            rate = tokens / seconds
            row = _row(experiment, label, t, tokens=tokens, seconds=seconds, via="engine", **extra)  # noqa: B023
            row["draft_dtype"] = cfg.draft_dtypes[0]
            row.update(speedup=rate / ar_rate, **_spec_fields(spec), **stats_fields(stats))  # noqa: B023
            if with_ppl:
                row["perplexity"] = perplexity(target.model, prompts, outputs)
            rows.append(row)
            _log(row)

        for depth in EXP1_DEPTHS:
            for label, spec in exp1_specs(depth):
                measure("exp1", label, spec)
        for budget in EXP2:
            for label, spec in exp2_specs(budget):
                measure("exp2", label, spec)
        for label, k, spec in mcsd_specs():
            measure("mcsd", label, spec, k=k)
        for label, spec in MTAD:
            measure("mtad", label, spec, with_ppl=True)
    return rows


def baselines(
    cfg: SuiteConfig, draft_bf16, target, texts: list[str], experiment: str = "baseline", **tags
) -> list[dict]:
    """transformers' own decoding of the same prompts: plain generate and assisted generation.
    tags: extra fields of every row (e.g. prompt_set)."""
    rows = []
    prompts = [target.tokenizer(t, return_tensors="pt")["input_ids"] for t in texts[: cfg.prompts]]
    eos = target.tokenizer.eos_token_id
    for t in cfg.temperatures:
        plain_rate = None
        for label, assistant in (("hf generate", None), ("hf assisted", draft_bf16.model)):
            tokens, seconds = 0, 0.0
            for i, ids in enumerate(prompts):
                torch.manual_seed(1000 + i)
                sampling = dict(temperature=t, top_k=0, top_p=1.0) if t > 0 else {}
                start = time.perf_counter()
                out = target.model.generate(
                    ids.to(target.device),
                    attention_mask=torch.ones_like(ids).to(target.device),
                    assistant_model=assistant,
                    max_new_tokens=cfg.max_new_tokens,
                    do_sample=t > 0,
                    repetition_penalty=1.0,
                    eos_token_id=eos,
                    pad_token_id=eos,
                    **sampling,
                )
                seconds += time.perf_counter() - start
                tokens += out.shape[1] - ids.shape[1]
            row = _row(
                experiment, label, t, tokens=tokens, seconds=seconds, via="transformers",
                method="hf_assisted" if assistant is not None else "hf_generate", draft_dtype="bf16", **tags,
            )  # fmt: skip
            plain_rate = plain_rate or row["tokens_per_second"]
            row["speedup"] = row["tokens_per_second"] / plain_rate
            rows.append(row)
            _log(row)
    return rows


# ---- through the gateway -----------------------------------------------------------------------


@contextlib.contextmanager
def running_stack(cfg: SuiteConfig, draft_dtype: str | None) -> Iterator[str]:
    """`specmesh up` on the suite's pair; draft_dtype None: `specmesh up` with its own defaults
    (no model flags at all)."""
    flags = []
    if draft_dtype is not None:
        flags = ["--draft", cfg.draft, "--target", cfg.target, "--dtype", cfg.dtype]
        flags += ["--draft-dtype", draft_dtype]
    with running_up(flags, draft_dtype or "default", probe="def f():") as address:
        yield address


@contextlib.contextmanager
def running_up(flags: Sequence[str], name: str, probe: str) -> Iterator[str]:
    """`specmesh up --no-demo <flags>` in a child process; yields the gateway address once a
    one-token request for `probe` succeeds."""
    with running_stack_plan(flags, name, probe) as (address, _, _):
        yield address


@contextlib.contextmanager
def running_stack_plan(
    flags: Sequence[str], name: str, probe: str
) -> Iterator[tuple[str, dict[str, str], dict[str, int]]]:
    """`running_up`, yielding (the gateway address, child name -> its /metrics host:port, child
    name -> its pid, Redis included)."""
    import grpc

    from specmesh.rpc.proto import load

    port = free_port()
    argv = [sys.executable, "-m", "specmesh.cli", "up", "--no-demo", "--port", str(port), *flags]
    if "--http-port" not in flags:  # the HTTP API (and the gateway's /metrics) on a free port, not 8000
        argv += ["--http-port", str(free_port())]
    log = tempfile.NamedTemporaryFile(  # noqa: SIM115 (closed in the finally below)
        "w", prefix=f"specmesh-stack-{name}-", suffix=".log", delete=False
    )
    child = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"127.0.0.1:{port}"
    try:
        pb2, pb2_grpc = load("gateway")
        deadline = time.monotonic() + 900
        while True:
            if child.poll() is not None:
                raise RuntimeError(f"specmesh up exited with {child.returncode}; see {log.name}")
            with grpc.insecure_channel(address) as channel:
                try:
                    request = pb2.GenerateRequest(prompt=probe, max_new_tokens=1)
                    pb2_grpc.GatewayStub(channel).Generate(request, timeout=30)
                    break
                except grpc.RpcError:
                    if time.monotonic() > deadline:
                        raise
            time.sleep(2)
        metrics, pids = _stack_children(Path(log.name))
        yield address, metrics, pids
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGTERM)
        try:
            child.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
        log.close()


def _stack_children(log: Path, timeout: float = 60.0) -> tuple[dict[str, str], dict[str, int]]:
    """(child name -> its /metrics host:port, child name -> its pid) from `specmesh up`'s log: the
    supervisor's "ready after ... (pid N)" lines and the "--- metrics of" lines it prints once every
    child is ready (a request may succeed a moment before they are written)."""
    deadline = time.monotonic() + timeout
    while True:
        metrics, pids = {}, {}
        for line in log.read_text().splitlines():
            if line.startswith("--- metrics of "):
                name, _, url = line.removeprefix("--- metrics of ").partition(": ")
                metrics[name] = url.split("://", 1)[-1].removesuffix("/metrics")
            ready = re.match(r"(\S+)\s+\| ready after [\d.]+s \(pid (\d+)\)$", line)
            if ready:
                pids[ready.group(1)] = int(ready.group(2))
        if ("gateway" in metrics and "gateway" in pids) or time.monotonic() > deadline:
            return metrics, pids
        time.sleep(0.2)


def gateway_rows(cfg: SuiteConfig, texts: list[str], phases: Sequence[str]) -> list[dict]:
    rows = []
    for n, draft_dtype in enumerate(cfg.draft_dtypes):
        scaling = "scaling" in phases and n == 0
        if "gateway" not in phases and not scaling:
            continue
        with running_stack(cfg, draft_dtype) as address:
            if "gateway" in phases:
                rows += _headline(cfg, address, texts, draft_dtype, full=n == 0)
            if scaling:
                rows += _scaling(cfg, address, texts, draft_dtype)
    return rows


def _headline(cfg: SuiteConfig, address: str, texts: list[str], draft_dtype: str, full: bool) -> list[dict]:
    """Autoregressive and every headline shape; with a second draft dtype only SECOND_DTYPE."""
    rows = []
    shapes = {"autoregressive": (AR, False)}
    shapes.update({k: v for k, v in cfg.headline.items() if full or k in SECOND_DTYPE})
    for t in cfg.temperatures:
        base = None
        for label, (spec, adaptive) in shapes.items():
            m = asyncio.run(
                run_gateway(address, texts[: cfg.prompts], spec, adaptive, t, cfg.max_new_tokens, 1)
            )
            dtype = draft_dtype if spec.method.drafts else None
            row = _row("headline", label, t, via="gateway", draft_dtype=dtype, **_spec_fields(spec), **m)
            row["method"] = "adaptive" if adaptive else spec.method
            base = base or row["tokens_per_second"]
            row["speedup"] = row["tokens_per_second"] / base
            if draft_dtype != cfg.draft_dtypes[0]:  # its own stack: its own autoregressive reference
                stack = f"{draft_dtype}-draft stack" if spec.method.drafts else f"{draft_dtype} stack"
                row["label"] = f"{label} ({stack})"
            rows.append(row)
            _log(row)
    return rows


def _scaling(cfg: SuiteConfig, address: str, texts: list[str], draft_dtype: str) -> list[dict]:
    rows = []
    shapes = {"autoregressive": (AR, False), **cfg.headline}
    for t in cfg.temperatures:
        for concurrency in cfg.scaling:
            base = None
            for label in SCALING:
                spec, adaptive = shapes[label]
                m = asyncio.run(
                    run_gateway(address, texts[:concurrency], spec, adaptive, t, cfg.scaling_max_new_tokens,
                                concurrency)
                )  # fmt: skip
                row = _row(
                    "scaling", label, t, via="gateway", concurrency=concurrency, draft_dtype=draft_dtype,
                    **_spec_fields(spec), **m,
                )  # fmt: skip
                row["method"] = "adaptive" if adaptive else spec.method
                base = base or row["tokens_per_second"]
                row["speedup"] = row["tokens_per_second"] / base
                rows.append(row)
                _log(row)
    return rows


# ---- the default path against what users run instead ------------------------------------------


DEFAULT_LABEL = "specmesh default"
FIXED = {
    "chain L=3": TreeSpec(Method.CHAIN, depth=3),
    "chain L=4": TreeSpec(Method.CHAIN, depth=4),
    "rsd_s 2x4": TreeSpec(Method.RSD_S, depth=4, beam_width=2),
}


def prompt_sets(cfg: SuiteConfig, tokenizer) -> dict[str, list[str]]:
    return {name: prompt_set(name, cfg.prompts, tokenizer) for name in PROMPT_SETS}


def default_rows(cfg: SuiteConfig, llama_server_binary: str | None = None) -> list[dict]:
    """The `default` phase (module docstring)."""
    from specmesh.runtime.model_store import DEFAULT_SOURCES, gguf_path
    from specmesh.runtime.models import load_model

    target = load_model(cfg.target, dtype=cfg.dtype)
    sets = prompt_sets(cfg, target.tokenizer)
    rows: list[dict] = []
    binary = find_llama_server(llama_server_binary)
    pair = [DEFAULT_SOURCES.get(source) for source in (cfg.draft, cfg.target)]
    if binary is None or None in pair:
        _note("default: no llama-server binary (scripts/build_llama_server.sh) or not the default pair: "
              "llama.cpp rows skipped")  # fmt: skip
    else:
        draft_gguf, target_gguf = (gguf_path(spec) for spec in pair)
        rows += _llama_server_rows(cfg, sets, binary, target_gguf, draft_gguf)
    draft = load_model(cfg.draft, dtype=cfg.dtype)
    for name, texts in sets.items():
        rows += baselines(cfg, draft, target, texts, "default", prompt_set=name)
    del draft, target
    gc.collect()
    with running_stack(cfg, None) as address:
        shapes: dict[str, TreeSpec | None] = {DEFAULT_LABEL: None, "none": AR, **FIXED}
        for name, texts in sets.items():
            for t in cfg.temperatures:
                for label, spec in shapes.items():
                    m = asyncio.run(run_gateway(address, texts, spec, False, t, cfg.max_new_tokens, 1))
                    rows.append(_gateway_row("default", label, t, spec, m, prompt_set=name))
        code = sets["code"]
        for t in cfg.temperatures:
            for concurrency in cfg.scaling:
                texts = (code * concurrency)[:concurrency]
                for label in ("none", DEFAULT_LABEL):
                    spec = shapes[label]
                    m = asyncio.run(
                        run_gateway(address, texts, spec, False, t, cfg.scaling_max_new_tokens, concurrency)
                    )
                    tags = dict(prompt_set="code", concurrency=concurrency)
                    rows.append(_gateway_row("default_scaling", label, t, spec, m, **tags))
    return _default_ratios(rows)


def _default_ratios(rows: list[dict]) -> list[dict]:
    """Each row's ratios to the references of its own prompt set and temperature (and, when
    scaling, concurrency): llama-server plain, transformers assisted, the stack's `none`."""

    def ref(row: dict, label: str) -> float | None:
        same = ("experiment", "prompt_set", "temperature", "concurrency")
        for r in rows:
            if r["label"] == label and all(r.get(k) == row.get(k) for k in same):
                return r.get("tokens_per_second")
        return None

    for row in rows:
        for key, label in (
            ("vs_llama_server", "llama-server"),
            ("vs_hf_assisted", "hf assisted"),
            ("speedup", "none"),
        ):
            base = ref(row, label)
            row[key] = row["tokens_per_second"] / base if base and row.get("tokens_per_second") else None
    return rows


def _llama_server_rows(
    cfg: SuiteConfig, sets: dict[str, list[str]], binary: Path, target: Path, draft: Path
) -> list[dict]:
    rows = []
    for label, draft_model in (("llama-server", None), ("llama-server -md", draft)):
        with llama_server(binary, target, draft_model) as url:
            for name, texts in sets.items():
                for t in cfg.temperatures:
                    m = run_llama_server(url, texts, t, cfg.max_new_tokens)
                    method = "llama_cpp_speculative" if draft_model else "llama_cpp"
                    row = _row("default", label, t, prompt_set=name, via="llama.cpp", method=method, **m)
                    rows.append(row)
                    _log(row)
    return rows


def _gateway_row(experiment: str, label: str, t: float, spec: TreeSpec | None, m: dict, **tags) -> dict:
    fields = _spec_fields(spec) if spec is not None else dict(method="default")
    row = _row(experiment, label, t, via="gateway", **tags, **fields, **m)
    _log(row)
    return row


# ---- the whole run -----------------------------------------------------------------------------


PHASE_OF = {  # a row's experiment -> the phase that measures it
    "baseline": "baselines",
    **dict.fromkeys(("exp1", "exp2", "mcsd", "mtad"), "sweeps"),
    "headline": "gateway",
    "scaling": "scaling",
    **dict.fromkeys(("default", "default_scaling"), "default"),
}
_progress: Progress | None = None  # run_suite's bar; without one (a phase run alone), a line per row


def plan(cfg: SuiteConfig) -> dict[str, int]:
    """Phase -> the rows it measures (one `_log` each), in run order: the progress bar's total."""
    from specmesh.runtime.model_store import DEFAULT_SOURCES

    temps = len(cfg.temperatures)
    stacks = [1 + len(cfg.headline)] + [
        1 + sum(label in SECOND_DTYPE for label in cfg.headline) for _ in cfg.draft_dtypes[1:]
    ]
    per_phase = {
        "baselines": 2 * temps,
        "sweeps": temps * (
            1 + sum(len(exp1_specs(d)) for d in EXP1_DEPTHS) + sum(len(exp2_specs(b)) for b in EXP2)
            + len(mcsd_specs()) + len(MTAD)
        ),
        "gateway": temps * sum(stacks),
        "scaling": temps * len(cfg.scaling) * len(SCALING),
    }  # fmt: skip
    if "default" in cfg.phases:
        sets = len(PROMPT_SETS)
        llama = find_llama_server(cfg.llama_server) is not None
        llama = llama and cfg.draft in DEFAULT_SOURCES and cfg.target in DEFAULT_SOURCES
        per_phase["default"] = (
            (2 * sets * temps if llama else 0)  # llama-server, plain and -md
            + 2 * sets * temps  # transformers, plain and assisted
            + sets * temps * (2 + len(FIXED))  # the stack: its default, none, the fixed shapes
            + 2 * temps * len(cfg.scaling)  # none and the default, concurrent
        )
    return {phase: n for phase, n in per_phase.items() if phase in cfg.phases}


def _summary(row: dict) -> str:
    eta = row.get("block_efficiency")
    return (
        f"T={row['temperature']:<3} {row['label']:<26} "
        f"{row.get('tokens_per_second', 0):6.2f} tok/s  x{row.get('speedup') or 0:4.2f}  "
        f"eta {eta if eta is not None else float('nan'):4.2f}"
        + (f"  c={row['concurrency']}" if row.get("concurrency") else "")
    )


def _log(row: dict) -> None:
    if _progress is not None:
        _progress.advance(PHASE_OF.get(row["experiment"], row["experiment"]), " ".join(_summary(row).split()))
    else:
        print(f"[{row['experiment']:<8}] {_summary(row)}", flush=True)


def _note(text: str) -> None:
    if _progress is not None:
        _progress.note(text)
    else:
        print(text, flush=True)


def _phase(name: str) -> None:
    if _progress is not None:
        _progress.phase(name)


def _model_name(source: str) -> str:
    from specmesh.runtime.model_store import DEFAULT_SOURCES

    known = DEFAULT_SOURCES.get(source)
    return f"{source} = {known.name} (GGUF Q4_K_M, dequantised)" if known else source


def meta(cfg: SuiteConfig, pair: Sequence[str], seconds: float) -> dict:
    import transformers

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return dict(
        machine=f"{platform.node()} ({os.cpu_count()} cores, {gpu})",
        cpu=cpu,
        threads=torch.get_num_threads(),
        dtype=cfg.dtype,
        draft_dtype=cfg.draft_dtypes[0],
        pair=[_model_name(p) for p in pair],
        date=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        torch=torch.__version__,
        transformers=transformers.__version__,
        prompts=cfg.prompts,
        max_new_tokens=cfg.max_new_tokens,
        sweep_prompts=cfg.sweep_prompts,
        sweep_max_new_tokens=cfg.sweep_max_new_tokens,
        command="specmesh bench report",
        seconds=seconds,  # the last invocation's
        phases_run=list(cfg.phases),  # by the last invocation; the rows' own dates say when
    )


ISSUE_ASSISTED_SPEEDUP = {0.0: 1.69, 1.0: 1.42}  # transformers assisted / plain, as the issue states


def goals(rows: list[dict]) -> list[dict]:
    """The issue's goals, from this run's rows (best row per goal)."""

    def pick(experiment: str, t: float, pred) -> list[dict]:
        return [r for r in rows if r["experiment"] == experiment and r["temperature"] == t and pred(r)]

    out = []
    for t, target in ((0.0, 2.0), (1.0, 1.7)):
        spec_rows = pick("headline", t, lambda r: r["method"] != Method.NONE)
        best = max(spec_rows, key=lambda r: r["tokens_per_second"], default=None)
        out.append(_goal(f"gateway vs autoregressive, T={t:g}", target, best and best["speedup"], best))
        hf = pick("baseline", t, lambda r: r["method"] == "hf_assisted")
        ratio = best["tokens_per_second"] / hf[0]["tokens_per_second"] if best and hf else None
        out.append(_goal(f"gateway vs transformers assisted, T={t:g}", 1.25, ratio, best))
        # The issue measured assisted generation at 1.69x / 1.42x plain generate on this machine;
        # also hold the gateway to that figure, in case this run's assisted number is low.
        plain = pick("baseline", t, lambda r: r["method"] == "hf_generate")
        quoted = ISSUE_ASSISTED_SPEEDUP[t]
        ratio = None
        if best and plain:
            ratio = best["tokens_per_second"] / (quoted * plain[0]["tokens_per_second"])
        name = f"gateway vs the issue's assisted figure ({quoted}x plain generate), T={t:g}"
        out.append(_goal(name, 1.25, ratio, best))
    exp1 = [r for r in rows if r["experiment"] == "exp1" and r["temperature"] == 1.0]
    ratios = []
    for depth in sorted({r["depth"] for r in exp1 if r["depth"]}):
        chain = [r for r in exp1 if r["depth"] == depth and r["method"] == Method.CHAIN]
        trees = [r for r in exp1 if r["depth"] == depth and r["method"] not in (Method.CHAIN, Method.NONE)]
        if chain and trees:
            tree = max(trees, key=lambda r: r["block_efficiency"])
            ratios.append((tree["block_efficiency"] / chain[0]["block_efficiency"], depth, tree["label"]))
    if ratios:
        ratio, depth, label = max(ratios)
        out.append(
            dict(name="best tree η / chain η at the same depth, T=1", target=1.15, measured=ratio,
                 met=ratio >= 1.15, detail=f"L={depth}: {label}; all depths: "
                 + ", ".join(f"L={d} {r:.2f}" for r, d, _ in sorted(ratios, key=lambda x: x[1])))
        )  # fmt: skip
    return out


def default_goals(rows: list[dict]) -> list[dict]:
    """The fast-by-default goals, from the `default` phase's rows."""
    out = []
    default = [r for r in rows if r["experiment"] == "default" and r["label"] == DEFAULT_LABEL]
    for row in default:
        where = f"{row['prompt_set']}, T={row['temperature']:g}"
        plain = 1.0 if row["prompt_set"] == "edit" else 0.9  # where n-gram drafts apply, speculation must pay
        out.append(_goal(f"default vs llama-server plain, {where}", plain, row.get("vs_llama_server"), row))
        out.append(_goal(f"default vs transformers assisted, {where}", 1.5, row.get("vs_hf_assisted"), row))
        fixed = [
            r for r in rows
            if r["experiment"] == "default" and r["label"] in FIXED
            and (r["prompt_set"], r["temperature"]) == (row["prompt_set"], row["temperature"])
        ]  # fmt: skip
        best = max(fixed, key=lambda r: r["tokens_per_second"], default=None)
        ratio = row["tokens_per_second"] / best["tokens_per_second"] if best else None
        out.append(_goal(f"default / best fixed shape in hindsight, {where}", 0.9, ratio, best))
    for row in rows:
        if row["experiment"] == "default_scaling" and row["label"] == DEFAULT_LABEL:
            name = f"default vs none at {row['concurrency']} streams, T={row['temperature']:g}"
            out.append(_goal(name, 1.0, row.get("speedup"), row))
    return out


def _goal(name: str, target: float, measured: float | None, row: dict | None) -> dict:
    detail = f"best: {row['label']} ({row.get('draft_dtype') or '-'} draft)" if row else ""
    met = None if measured is None else measured >= target
    return dict(name=name, target=target, measured=measured, met=met, detail=detail)


def _measure(cfg: SuiteConfig) -> tuple[list[dict], set[str]]:
    """The phases' rows, and the experiments they measured."""
    from specmesh.runtime.models import load_model

    texts = humaneval_prompts(max(cfg.prompts, cfg.sweep_prompts, *cfg.scaling))
    rows: list[dict] = []
    redone: set[str] = set()
    if "sweeps" in cfg.phases or "baselines" in cfg.phases:
        _phase("baselines" if "baselines" in cfg.phases else "sweeps")
        target = load_model(cfg.target, dtype=cfg.dtype)
        if "baselines" in cfg.phases:
            draft_bf16 = load_model(cfg.draft, dtype=cfg.dtype)
            rows += baselines(cfg, draft_bf16, target, texts)
            redone.add("baseline")
            del draft_bf16
        if "sweeps" in cfg.phases:
            _phase("sweeps")
            draft = load_model(cfg.draft, dtype=cfg.draft_dtypes[0])
            rows += sweeps(cfg, draft, target, texts)
            redone |= {"exp1", "exp2", "mcsd", "mtad"}
            del draft
        del target
        gc.collect()
    if "gateway" in cfg.phases or "scaling" in cfg.phases:
        _phase("gateway" if "gateway" in cfg.phases else "scaling")
        rows += gateway_rows(cfg, texts, cfg.phases)
    if "default" in cfg.phases:
        _phase("default")
        rows += default_rows(cfg, cfg.llama_server)
        redone |= {"default", "default_scaling"}
    return rows, redone


def run_suite(cfg: SuiteConfig) -> dict:
    """Run the phases, merge with the rows of phases not re-run, write JSON + the report."""
    cfg.out.mkdir(parents=True, exist_ok=True)
    path = cfg.out / "results.json"
    old = json.loads(path.read_text()) if path.exists() else {"rows": []}
    started = time.perf_counter()
    global _progress
    planned = plan(cfg)
    _progress = Progress(planned) if any(planned.values()) else None  # a bar with an ETA, on stderr
    try:
        rows, redone = _measure(cfg)
    finally:
        progress, _progress = _progress, None
        if progress is not None:
            progress.close()
    redone |= {"headline"} if "gateway" in cfg.phases else set()
    redone |= {"scaling"} if "scaling" in cfg.phases else set()
    rows = [r for r in old["rows"] if r["experiment"] not in redone] + rows
    info = meta(cfg, (cfg.draft, cfg.target), time.perf_counter() - started)
    if not redone:  # only re-rendering: the measurements' own meta stands
        info.update(
            {k: old["meta"][k] for k in ("date", "seconds", "phases_run") if k in old.get("meta", {})}
        )
    measured: dict[str, str] = {}
    for r in rows:
        measured[r["experiment"]] = min(measured.get(r["experiment"], r.get("date", "?")), r.get("date", "?"))
    info["measured"] = measured
    results = dict(meta=info, goals=goals(rows) + default_goals(rows), rows=rows)
    path.write_text(json.dumps(results, indent=1))
    write_report(results, cfg.out)
    return results
