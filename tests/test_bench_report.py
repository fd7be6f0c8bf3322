"""specmesh.bench.report: the markdown report and its plots from a synthetic results dict."""

from __future__ import annotations

import re

import pytest

from specmesh.bench.report import write_report

SECTIONS = {
    "baseline": "## Headline: through the gateway",
    "exp1": "## Exp1: fixed depth L",
    "exp2": "## Exp2: fixed node budget B",
    "mcsd": "## MCSD: k = 1 vs k = 4 and the best k-config",
    "mtad": "## MTAD vs chain",
    "scaling": "## Scaling: concurrent sessions through the gateway",
}
PLOTS = {"headline.png", "exp1.png", "exp1_speedup.png", "exp2.png", "exp2_speedup.png", "scaling.png"}


def row(experiment: str, temperature: float, label: str, method: str, **fields) -> dict:
    """A results row; fields the experiment does not measure are left absent or None."""
    return {
        "experiment": experiment,
        "temperature": temperature,
        "label": label,
        "method": method,
        "via": "engine",
        "tokens": 256,
        "seconds": 10.0,
        **fields,
    }


def meta() -> dict:
    return {
        "machine": "bench-box-7",
        "cpu": "Xeon Test 9999",
        "threads": 16,
        "dtype": "bf16",
        "draft_dtype": "int8",
        "pair": ["org/draft-0.5b", "org/target-7b"],
        "date": "2031-04-05",
        "torch": "2.13.0",
        "transformers": "5.23.1",
        "prompts": 8,
        "max_new_tokens": 128,
        "sweep_prompts": 4,
        "sweep_max_new_tokens": 64,
        "command": "specmesh bench all --out bench/",
        "seconds": 5400.0,
    }


def full_results() -> dict:
    rows = []
    for t in (0.0, 1.0):
        rows += [
            row("baseline", t, "autoregressive", "none", via="gateway", tokens_per_second=10.0, speedup=1.0),
            row("baseline", t, "hf assisted", "hf_assisted", via="transformers", tokens_per_second=14.0),
            row(
                "headline",
                t,
                "adaptive",
                "adaptive",
                via="gateway",
                draft_dtype="int8",
                tokens_per_second=15.3456 + t,
                speedup=1.5346 + t / 10,
                block_efficiency=2.104,
                draft_seconds=1.5,
                verify_seconds=6.25,
                network_seconds=None,
            ),
        ]
        for depth in (2, 3):
            rows += [
                row(
                    "exp1",
                    t,
                    f"chain L={depth}",
                    "chain",
                    depth=depth,
                    nodes=depth,
                    block_efficiency=1.5 + depth / 10,
                    acceptance_per_depth=[0.9, 0.72, 0.5][:depth],
                    tokens_per_second=11.0 + depth,
                    speedup=1.1 + depth / 10,
                ),
                row(
                    "exp1",
                    t,
                    f"rsd_s {depth}x2",
                    "rsd_s",
                    depth=depth,
                    nodes=2 * depth,
                    block_efficiency=1.9 + depth / 10,
                    tokens_per_second=12.0,
                    speedup=1.2,
                ),
                row("exp1", t, f"mcsd wor 2-{depth}", "mcsd", depth=depth, nodes=4, block_efficiency=1.7),
                row("exp1", t, f"mcsd iid 2-{depth}", "mcsd", depth=depth, nodes=4, block_efficiency=None),
            ]
        for nodes in (4, 8):
            rows += [
                row(
                    "exp2",
                    t,
                    f"rsd_c B={nodes}",
                    "rsd_c",
                    depth=3,
                    nodes=nodes,
                    block_efficiency=2.0 + nodes / 100,
                    tokens_per_second=13.5,
                    speedup=1.35,
                ),
                row(
                    "exp2",
                    t,
                    f"chain B={nodes}",
                    "chain",
                    depth=nodes,
                    nodes=nodes,
                    block_efficiency=1.8,
                    tokens_per_second=12.25,
                    speedup=1.225,
                ),
            ]
        rows += [
            row("mcsd", t, "autoregressive", "none", tokens_per_second=10.0, speedup=1.0),
            row(
                "mcsd",
                t,
                "mcsd wor 1-1-1",
                "mcsd",
                k=1,
                depth=3,
                nodes=3,
                alpha=0.61,
                block_efficiency=1.9,
                tokens_per_second=13.0,
                speedup=1.3,
            ),
            row(
                "mcsd",
                t,
                f"mcsd wor 4-1-1 T{t:g}",
                "mcsd",
                k=4,
                depth=3,
                nodes=6,
                alpha=0.777,
                block_efficiency=2.456,
                tokens_per_second=17.0,
                speedup=1.7 + t,
            ),
            row(
                "mtad",
                t,
                "chain L=3",
                "chain",
                block_efficiency=1.8,
                tokens_per_second=12.0,
                speedup=1.2,
                perplexity=3.14159,
            ),
            row(
                "mtad",
                t,
                "mtad L=3",
                "mtad",
                block_efficiency=1.95,
                tokens_per_second=12.5,
                speedup=1.25,
                perplexity=None,
            ),
        ]
        for n in (1, 4):
            rows.append(
                row(
                    "scaling",
                    t,
                    "adaptive",
                    "adaptive",
                    via="gateway",
                    concurrency=n,
                    tokens_per_second=15.0 * n,
                    token_latency_p50_ms=60.4 * n,
                    token_latency_p95_ms=95.6 * n,
                    ttft_p50_ms=200.0,
                    ttft_p95_ms=349.5,
                    block_efficiency=2.0,
                )
            )
    goals = [
        {
            "name": "headline speedup T=0",
            "target": 1.5,
            "measured": 1.5346,
            "met": True,
            "detail": "adaptive",
        },
        {"name": "scaling p95", "target": 120.0, "measured": None, "met": None, "detail": "not run"},
        {"name": "mtad perplexity", "target": 3.0, "measured": 3.14159, "met": False, "detail": "above"},
    ]
    return {"meta": meta(), "goals": goals, "rows": rows}


def table_rows(text: str, first_cell: str) -> list[list[str]]:
    """Cells of the markdown table rows whose first cell is `first_cell`."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()]
    return [r for r in rows if r and r[0] == first_cell]


def images(text: str) -> set[str]:
    return set(re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text))


def test_full_report(tmp_path):
    readme = write_report(full_results(), tmp_path / "out")
    assert readme == tmp_path / "out" / "README.md"
    text = readme.read_text(encoding="utf-8")

    assert text.startswith("# Benchmarks\n")
    assert "## Goals" in text
    for heading in SECTIONS.values():
        assert heading in text
    for field in (
        "bench-box-7",
        "Xeon Test 9999",
        "16 threads",
        "bf16",
        "int8",
        "org/draft-0.5b",
        "org/target-7b",
        "2031-04-05",
        "2.13.0",
        "5.23.1",
    ):
        assert field in text
    assert "8 prompts × 128 new tokens" in text and "4 prompts × 64 new tokens" in text
    assert "5400 s (90.0 min)" in text
    assert "```bash\nspecmesh bench all --out bench/\n```" in text

    # goals: formatted numbers and the three met states
    assert table_rows(text, "headline speedup T=0") == [
        ["headline speedup T=0", "1.50", "1.53", "✅", "adaptive"]
    ]
    assert table_rows(text, "scaling p95") == [["scaling p95", "120.00", "–", "–", "not run"]]
    assert table_rows(text, "mtad perplexity")[0][3] == "❌"

    # headline: tok/s 2 decimals, speedup as a ratio, η, the draft / verify / network split with a gap
    headline = text.split(SECTIONS["baseline"])[1].split("## Exp1")[0]
    assert "### T=0" in headline and "### T=1" in headline
    adaptive = table_rows(headline, "adaptive")
    assert adaptive[0] == ["adaptive", "gateway", "int8", "15.35", "1.53x", "2.10", "1.50 / 6.25 / –"]
    assert adaptive[1][3:5] == ["16.35", "1.63x"]
    assert table_rows(headline, "hf assisted")[0] == [
        "hf assisted",
        "transformers",
        "–",
        "14.00",
        "–",
        "–",
        "– / – / –",
    ]
    assert headline.index("| autoregressive") < headline.index("| adaptive")  # baseline rows first

    # exp1: one row per (L, label), acceptance per depth space-separated
    exp1 = text.split(SECTIONS["exp1"])[1].split("## Exp2")[0]
    assert ["3", "chain L=3", "3", "1.80", "0.90 0.72 0.50", "14.00", "1.40x"] in table_rows(exp1, "3")
    assert ["2", "mcsd iid 2-2", "4", "–", "–", "–", "–"] in table_rows(exp1, "2")
    assert len(table_rows(exp1, "2")) == 2 * 4  # four methods, both temperatures

    exp2 = text.split(SECTIONS["exp2"])[1].split("## MCSD")[0]
    assert ["8", "rsd_c B=8", "3", "2.08", "13.50", "1.35x"] in table_rows(exp2, "8")

    mcsd = text.split(SECTIONS["mcsd"])[1].split("## MTAD")[0]
    assert table_rows(mcsd, "mcsd wor 4-1-1 T0") == [
        ["mcsd wor 4-1-1 T0", "4", "3", "6", "0.78", "2.46", "17.00", "1.70x"]
    ]
    assert "best k-config at T=0: mcsd wor 4-1-1 T0 (1.70x, η 2.46)" in mcsd
    assert "best k-config at T=1: mcsd wor 4-1-1 T1 (2.70x, η 2.46)" in mcsd

    mtad = text.split(SECTIONS["mtad"])[1].split("## Scaling")[0]
    assert table_rows(mtad, "0") == [
        ["0", "chain L=3", "1.80", "12.00", "1.20x", "3.14"],
        ["0", "mtad L=3", "1.95", "12.50", "1.25x", "–"],
    ]
    assert len(table_rows(mtad, "1")) == 2

    scaling = text.split(SECTIONS["scaling"])[1]
    assert ["4", "adaptive", "60.00", "242 / 382", "200 / 350", "2.00"] in table_rows(scaling, "4")

    assert images(text) == PLOTS
    for name in PLOTS:
        assert (tmp_path / "out" / name).read_bytes().startswith(b"\x89PNG")


def test_baseline_only(tmp_path):
    results = {
        "meta": meta(),
        "goals": [],
        "rows": [row("baseline", 0.0, "autoregressive", "none", tokens_per_second=9.5, speedup=1.0)],
    }
    text = write_report(results, tmp_path).read_text(encoding="utf-8")
    assert SECTIONS["baseline"] in text
    assert table_rows(text, "autoregressive")[0][3:5] == ["9.50", "1.00x"]
    for experiment, heading in SECTIONS.items():
        assert (heading in text) == (experiment == "baseline")
    assert "## Goals" not in text
    assert images(text) == {"headline.png"}
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["headline.png"]


def test_unmeasured_rows_and_missing_meta(tmp_path):
    """Rows with nothing to plot still get tables (all dashes) but no plot; absent meta fields are dashes."""
    results = {
        "meta": {"machine": "m"},
        "rows": [
            row("exp1", 1.0, "chain L=2", "chain", depth=2),
            row("scaling", 0.0, "adaptive", "adaptive"),
        ],
    }
    text = write_report(results, tmp_path).read_text(encoding="utf-8")
    assert "- Target dtype: –; draft dtype: –" in text
    assert next(line for line in text.splitlines() if "wall time" in line.lower()).endswith(": –")
    assert ["2", "chain L=2", "–", "–", "–", "–", "–"] in table_rows(text, "2")
    assert ["–", "adaptive", "–", "– / –", "– / –", "–"] in table_rows(text, "–")
    assert SECTIONS["exp1"] in text and SECTIONS["scaling"] in text and SECTIONS["baseline"] not in text
    assert images(text) == set()
    assert list(tmp_path.glob("*.png")) == []


def test_default_section(tmp_path):
    fields = dict(prompt_set="chat", via="gateway", tokens_per_second=9.0, vs_llama_server=0.3)
    rows = [
        row("default", 0.0, "specmesh default", "default", vs_hf_assisted=1.1, speedup=1.4, **fields),
        row(
            "default",
            0.0,
            "llama-server",
            "llama_cpp",
            prompt_set="chat",
            via="llama.cpp",
            tokens_per_second=30.0,
        ),
        row(
            "default_scaling",
            1.0,
            "specmesh default",
            "default",
            prompt_set="code",
            concurrency=4,
            speedup=0.97,
        ),
    ]
    text = write_report({"meta": meta(), "goals": [], "rows": rows}, tmp_path).read_text(encoding="utf-8")
    assert "## Fast by default" in text and "### prompts: chat" in text
    assert table_rows(text, "specmesh default")[0][:6] == [
        "specmesh default",
        "gateway",
        "9.00",
        "0.30x",
        "1.10x",
        "1.40x",
    ]
    assert table_rows(text, "4")[0][:2] == ["4", "specmesh default"] and "0.97x" in table_rows(text, "4")[0]


# ---- the progress bar of `specmesh bench report` ---------------------------------------------------


def test_progress_bar_counts_the_plan_with_an_eta_and_sums_up_each_phase():
    import io

    from specmesh.bench.progress import Progress, duration

    clock = [100.0]
    out = io.StringIO()
    progress = Progress({"sweeps": 3, "gateway": 2}, file=out, clock=lambda: clock[0])
    progress.phase("sweeps")
    clock[0] += 5  # loading the models counts towards the phase
    for depth in (2, 3, 4):
        progress.advance("sweeps", f"T=0 chain L={depth} 12.00 tok/s")
        clock[0] += 10
    progress.note("default: no llama-server binary")
    progress.advance("gateway", "T=0 autoregressive 9.00 tok/s")
    clock[0] += 65
    progress.advance("gateway", "T=0 chain L=4 14.00 tok/s")
    assert progress.bar.n == progress.bar.total == 5
    lines = progress.close()
    assert lines == ["sweeps: 3/3 rows in 35s", "gateway: 2/2 rows in 1m 05s", "5 rows in 1m 40s"]
    text = out.getvalue()
    assert "ETA" in text and "5/5 rows" in text and "0/5 rows" in text
    assert "default: no llama-server binary\n" in text  # a note is a line of its own
    assert "T=0 chain L=4 14.00 tok/s" in text  # the last row beside the bar
    assert text.endswith("\n".join(lines) + "\n")
    assert [duration(s) for s in (7, 65, 3725)] == ["7s", "1m 05s", "1h 02m"]


@pytest.mark.parametrize("llama", [False, True])
def test_the_suite_plan_counts_every_row_it_measures(tmp_path, monkeypatch, capsys, llama):
    """run_suite on fakes of every model, stack and measurement: the bar ends at exactly its total,
    and stdout has no line per row."""
    import contextlib

    import torch

    import specmesh.runtime.engine
    import specmesh.runtime.model_store
    import specmesh.runtime.models
    from specmesh.bench import suite

    class Tokenizer:
        eos_token_id = 0

        def __call__(self, text, return_tensors=None):
            return {"input_ids": torch.tensor([[1, 2, 3]]) if return_tensors else [1, 2, 3]}

    class Model:
        tokenizer, device = Tokenizer(), "cpu"

        def __init__(self):
            self.model = self

        def generate(self, ids, **kwargs):
            return torch.cat([ids, ids], dim=1)

    class Engine:
        def __init__(self, draft, target):
            pass

        def generate(self, *args):
            return None

    @contextlib.contextmanager
    def running(*args):
        yield "127.0.0.1:1"

    async def run_gateway(*args):
        return dict(tokens=10, seconds=1.0)

    monkeypatch.setattr(specmesh.runtime.models, "load_model", lambda *a, **k: Model())
    monkeypatch.setattr(specmesh.runtime.engine, "SpeculativeEngine", Engine)
    monkeypatch.setattr(specmesh.runtime.model_store, "gguf_path", lambda spec: tmp_path / "m.gguf")
    monkeypatch.setattr(suite, "humaneval_prompts", lambda n: [f"prompt {i}" for i in range(n)])
    monkeypatch.setattr(
        suite, "run_engine", lambda engine, prompts, *a: (10, 1.0, None, [[1]] * len(prompts))
    )
    monkeypatch.setattr(suite, "stats_fields", lambda stats: {})
    monkeypatch.setattr(suite, "perplexity", lambda *a: 1.0)
    monkeypatch.setattr(suite, "running_stack", running)
    monkeypatch.setattr(suite, "run_gateway", run_gateway)
    monkeypatch.setattr(suite, "prompt_sets", lambda cfg, tok: {name: ["p"] for name in suite.PROMPT_SETS})
    monkeypatch.setattr(
        suite, "find_llama_server", lambda binary: tmp_path / "llama-server" if llama else None
    )
    monkeypatch.setattr(suite, "llama_server", running)
    monkeypatch.setattr(suite, "run_llama_server", lambda *a: dict(tokens=10, seconds=1.0))
    monkeypatch.setattr(suite, "meta", lambda *a: {})
    monkeypatch.setattr(suite, "goals", lambda rows: [])
    monkeypatch.setattr(suite, "default_goals", lambda rows: [])
    monkeypatch.setattr(suite, "write_report", lambda results, out: None)

    cfg = suite.SuiteConfig(out=tmp_path, scaling=(1, 2), draft_dtypes=("int8", "bf16"))
    planned = suite.plan(cfg)
    assert set(planned) == set(suite.PHASES)
    results = suite.run_suite(cfg)
    measured = {}
    for r in results["rows"]:
        phase = suite.PHASE_OF[r["experiment"]]
        measured[phase] = measured.get(phase, 0) + 1
    measured["sweeps"] -= 2 * len(cfg.temperatures)  # one autoregressive run: rows of exp1, exp2, mtad
    assert measured == planned
    out, err = capsys.readouterr()
    total = sum(planned.values())
    assert f"{total}/{total} rows" in err and "ETA" in err
    for phase, n in planned.items():
        assert re.search(rf"^{phase}: {n}/{n} rows in ", err, re.M)
    assert ("llama.cpp rows skipped" in err) != llama
    assert "tok/s" not in out  # no line per row


def test_one_session_rows_run_every_engine_on_a_prompt_before_the_next_in_a_rotated_order():
    from specmesh.bench.default_path import FIRST_SEED, interleaved

    calls: list[tuple[str, list[str], int]] = []

    def engine(name: str):
        def run(texts: list[str], seed: int) -> dict:
            calls.append((name, texts, seed))
            calls_made = 2 if name == "b" else 1
            return dict(
                tokens=10,
                seconds=1.0 + seed - FIRST_SEED,
                target_calls=calls_made,
                block_efficiency=seed - 999.0,
            )

        return run

    out = interleaved({"a": engine("a"), "b": engine("b"), "c": engine("c")}, ["p0", "p1", "p2", "p3"])
    order = [(name, texts[0], seed - FIRST_SEED) for name, texts, seed in calls]
    assert order == [
        ("a", "p0", 0), ("b", "p0", 0), ("c", "p0", 0),
        ("b", "p1", 1), ("c", "p1", 1), ("a", "p1", 1),
        ("c", "p2", 2), ("a", "p2", 2), ("b", "p2", 2),
        ("a", "p3", 3), ("b", "p3", 3), ("c", "p3", 3),
    ]  # fmt: skip
    assert out["a"]["tokens"] == 40 and out["a"]["seconds"] == 1 + 2 + 3 + 4
    # block efficiency 1, 2, 3, 4 over equal calls averages to 2.5 (not summed)
    assert out["b"]["block_efficiency"] == pytest.approx(2.5)
    assert "target_calls" not in out["b"] and "draft_acceptance" not in out["b"]
