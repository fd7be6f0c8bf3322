"""Gateway tokens/s on a running stack: the same prompts, methods and seeds as `bench engine`.

Start the stack first (`specmesh up`), then `specmesh bench gateway --address HOST:PORT`. With
`--engine-json` (the output of `specmesh bench engine`) each row also shows the in-process
engine's tokens/s for the same method: the ratio is the cost of the network and the services.
"""

from __future__ import annotations

import asyncio
import json
import time

from specmesh.bench.engine import DEFAULT_SPECS
from specmesh.bench.measure import chat_questions, humaneval_prompts, run_gateway
from specmesh.core.drafting import TreeSpec


def bench_gateway(
    address: str,
    prompts: int = 3,
    max_new_tokens: int = 64,
    temperatures: tuple[float, ...] = (0.0, 1.0),
    engine_json: str | None = None,
    dsi_parallel: int = 0,
    chat: bool = False,
) -> dict:
    """dsi_parallel > 0: the rows are plain decoding, SI (chain-3), DSI with a lookahead of 3 and
    that many verifications in flight (the paper's DSI, drafting ahead), and DSI with a lookahead of
    3 and the rest left to the gateway (`dsi-3-auto`: it may choose SI's schedule), instead of the
    engine's methods."""
    engine = {}
    if engine_json:
        with open(engine_json) as f:
            engine = {(r["method"], r["temperature"]): r for r in json.load(f)["rows"]}
    texts = chat_questions(prompts) if chat else humaneval_prompts(prompts)
    rows = []
    for temperature in temperatures:
        base = None
        for name, spec, parallel in _rows(dsi_parallel):
            measured = asyncio.run(
                run_gateway(
                    address,
                    texts,
                    spec,
                    False,
                    temperature,
                    max_new_tokens,
                    1,
                    dsi_parallel=parallel,
                    chat=chat,
                )
            )
            row = dict(method=name, temperature=temperature, **measured)
            row["tokens_per_second"] = row["tokens"] / row["seconds"]
            base = base or row
            ref = engine.get((name, temperature))
            row["engine_tokens_per_second"] = ref["tokens_per_second"] if ref else None
            rows.append(row)
            vs_engine = f"x{row['tokens_per_second'] / ref['tokens_per_second']:.2f} of engine" if ref else ""
            shapes = f"  dsi (lookahead, parallel, ahead): {row['dsi_shapes']}" if row["dsi_shapes"] else ""
            print(
                f"T={temperature:<3} {name:<12} {row['tokens_per_second']:6.2f} tok/s  "
                f"x{row['tokens_per_second'] / base['tokens_per_second']:4.2f} vs AR  "
                f"eta {row['block_efficiency']:4.2f}  network {row['network_seconds']:5.1f}s  {vs_engine}"
                f"{shapes}",
                flush=True,
            )
    return dict(address=address, date=time.strftime("%Y-%m-%d %H:%M:%S"), rows=rows)


def _rows(dsi_parallel: int) -> list[tuple[str, TreeSpec, int | None]]:
    if not dsi_parallel:
        return [(name, spec, None) for name, spec in DEFAULT_SPECS.items()]
    chain = DEFAULT_SPECS["chain-3"]
    return [
        ("none", DEFAULT_SPECS["none"], None),
        ("chain-3", chain, None),
        (f"dsi-3x{dsi_parallel}", chain, dsi_parallel),
        ("dsi-3-auto", chain, 0),
    ]
