"""Quick engine tokens/s on the real pair: autoregressive vs chain vs tree methods, same run.

`specmesh bench report` (suite.py) is the full benchmark; this is the two-minute check. Each
method generates from the same HumanEval prompts with the same seeds; speed is a ratio to plain
autoregressive decoding measured in the same process.
"""

from __future__ import annotations

import platform
import time

import torch

from specmesh.bench.measure import humaneval_prompts, run_engine, stats_fields
from specmesh.core.drafting import TreeSpec
from specmesh.core.methods import Method
from specmesh.core.sampling import SamplingParams

DEFAULT_SPECS = {
    "none": TreeSpec(Method.NONE),
    "chain-3": TreeSpec("chain", depth=3),
    "rsd_s-3x3": TreeSpec("rsd_s", depth=3, beam_width=3),
    "mcsd-2x2x1": TreeSpec("mcsd", depth=3, branching=(2, 2, 1)),
}


def bench_engine(
    draft: str = "default-draft",
    target: str = "default-target",
    dtype: str = "bf16",
    prompts: int = 3,
    max_new_tokens: int = 64,
    temperatures: tuple[float, ...] = (0.0, 1.0),
    specs: dict[str, TreeSpec] | None = None,
    backend: str = "torch",
) -> dict:
    from specmesh.runtime.engine import SpeculativeEngine
    from specmesh.runtime.models import load_model

    specs = specs or DEFAULT_SPECS
    d, t = load_model(draft, dtype=dtype, backend=backend), load_model(target, dtype=dtype, backend=backend)
    engine = SpeculativeEngine(d, t)
    ids = [t.tokenizer(text)["input_ids"] for text in humaneval_prompts(prompts)]
    engine.generate(ids[0], TreeSpec("chain", depth=2), SamplingParams(0.0), 4)  # warm-up
    rows = []
    for temperature in temperatures:
        base = float("nan")  # the "none" row's tokens/s, when the specs have one
        for name, spec in specs.items():
            tokens, seconds, stats, _ = run_engine(engine, ids, spec, temperature, max_new_tokens)
            row = dict(method=name, temperature=temperature, tokens=tokens, seconds=seconds)
            row.update(tokens_per_second=tokens / seconds, target_calls=stats.rounds, **stats_fields(stats))
            if not spec.method.drafts:
                base = row["tokens_per_second"]
            rows.append(row)
            acc = " ".join(f"{a:.2f}" for a in row["acceptance_per_depth"])
            print(
                f"T={temperature:<3} {name:<12} {row['tokens_per_second']:6.2f} tok/s  "
                f"x{row['tokens_per_second'] / base:4.2f} vs AR  eta {row['block_efficiency']:4.2f}  "
                f"draft {row['draft_seconds']:6.1f}s verify {row['verify_seconds']:6.1f}s  acc/depth [{acc}]",
                flush=True,
            )
    return dict(
        machine=f"{platform.node()} {platform.processor() or platform.machine()}",
        threads=torch.get_num_threads(),
        dtype=dtype,
        backend=str(t.backend),
        pair=[d.source, t.source],
        date=time.strftime("%Y-%m-%d %H:%M:%S"),
        max_new_tokens=max_new_tokens,
        prompts=prompts,
        rows=rows,
    )
