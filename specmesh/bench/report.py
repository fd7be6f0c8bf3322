"""Markdown report plus PNG plots for one benchmark run (`specmesh bench report`).

The input is the results dict the benchmark writes as JSON (`meta`, `goals`, `rows`). Every speedup in
it is a ratio to the autoregressive row measured in the same run, so the report never compares runs.
Missing values render as a dash and are left out of plots; an experiment without rows has no section.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable, Iterable

from specmesh.core.methods import Method

DASH = "–"
Series = dict[str, list[tuple[float, float]]]  # line name -> sorted (x, y) points


# ---- formatting ------------------------------------------------------------------------------------


def _fmt(value, spec: str = ".2f", suffix: str = "") -> str:
    """A number formatted with `spec`, or a dash when the benchmark did not measure it."""
    return DASH if value is None else f"{value:{spec}}{suffix}"


def _x(value) -> str:
    """Speedup ratio, e.g. 1.53x."""
    return _fmt(value, ".2f", "x")


def _ms(value) -> str:
    return _fmt(value, ".0f")


def _text(value) -> str:
    """Free text for a table cell: pipes would split the cell."""
    return DASH if value is None or value == "" else str(value).replace("|", "\\|")


def _temp(t: float) -> str:
    return f"T={t:g}"


def _table(header: list[str], body: Iterable[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(cells) + " |" for cells in body]


# ---- row selection ---------------------------------------------------------------------------------


def _by_temperature(rows: list[dict]) -> list[tuple[float, list[dict]]]:
    """Rows grouped by temperature, coldest first, each group in input order."""
    temps = sorted({float(r.get("temperature") or 0.0) for r in rows})
    return [(t, [r for r in rows if float(r.get("temperature") or 0.0) == t]) for t in temps]


def _key(value) -> float:
    """Sort key that puts missing values (e.g. the autoregressive row's depth) first."""
    return -1.0 if value is None else float(value)


def _family(row: dict) -> str:
    """Plot line for a method; mcsd splits by sampling scheme since iid and wor behave differently."""
    if row.get("method") == Method.MCSD:
        return "mcsd wor" if "wor" in (row.get("label") or "") else "mcsd iid"
    return row.get("method") or "?"


def _best_by_family(rows: list[dict], x_key: str, y_key: str) -> Series:
    """Per method family and x, the best y: the sweep's frontier, not every config."""
    best: dict[tuple[str, float], float] = {}
    for r in rows:
        x, y = r.get(x_key), r.get(y_key)
        if x is not None and y is not None:
            k = (_family(r), x)
            best[k] = max(best.get(k, y), y)
    series: Series = {}
    for (family, x), y in sorted(best.items()):
        series.setdefault(family, []).append((x, y))
    return series


# ---- plots -----------------------------------------------------------------------------------------


def _pyplot():
    """pyplot on the Agg backend, imported only when a plot is drawn (no display on benchmark hosts)."""
    try:
        import matplotlib
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError("the report's plots need matplotlib: pip install 'specmesh[bench]'") from e

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: pathlib.Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def _line_plot(panels: list[tuple[str, str, Series]], xlabel: str, path: pathlib.Path) -> str | None:
    """Side-by-side panels (title, y label, series); returns the file name, or None with nothing to plot."""
    if not any(series for _, _, series in panels):
        return None
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, (title, ylabel, series) in zip(axes[0], panels, strict=True):
        for name, points in series.items():
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, marker="o", label=name)
        ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if series:
            ax.legend(fontsize=8)
    return _save(plt, fig, path)


def _bar_plot(groups: list[tuple[str, dict[str, float]]], ylabel: str, path: pathlib.Path) -> str | None:
    """Grouped bars: one group per (name, {label: value}), one colour per label across groups."""
    labels = list(dict.fromkeys(label for _, values in groups for label in values))
    if not labels:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(labels) * len(groups) + 2), 4))
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        offset = (i - (len(labels) - 1) / 2) * width
        points = [(g + offset, values[label]) for g, (_, values) in enumerate(groups) if label in values]
        ax.bar(*zip(*points, strict=True), width, label=label)
    ax.set_xticks(range(len(groups)), [name for name, _ in groups])
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def _image(alt: str, name: str | None) -> list[str]:
    return ["", f"![{alt}]({name})"] if name else []


# ---- sections --------------------------------------------------------------------------------------

Column = tuple[str, Callable[[dict], str]]  # header, cell of one row


def _col(header: str, *keys: str, fmt: Callable = _fmt) -> Column:
    """A column of one value per row, or of several related ones (p50 / p95) in one cell."""
    return header, lambda r: " / ".join(fmt(r.get(k)) for k in keys)


def _rows_table(columns: list[Column], rows: list[dict]) -> list[str]:
    return _table([h for h, _ in columns], ([cell(r) for _, cell in columns] for r in rows))


def _acceptance(row: dict) -> str:
    values = row.get("acceptance_per_depth")
    return " ".join(f"{v:.2f}" for v in values) if values else DASH


LABEL = _col("label", "label", fmt=_text)
ETA = _col("η", "block_efficiency")
TPS = _col("tok/s", "tokens_per_second")
SPEEDUP = _col("speedup", "speedup", fmt=_x)
HEADLINE_COLUMNS = [
    LABEL,
    _col("via", "via", fmt=_text),
    _col("draft dtype", "draft_dtype", fmt=_text),
    TPS,
    _col("vs autoregressive", "speedup", fmt=_x),
    ETA,
    _col("draft s / verify s / network s", "draft_seconds", "verify_seconds", "network_seconds"),
]
EXP1_COLUMNS = [
    _col("L", "depth", fmt=_text),
    LABEL,
    _col("nodes", "nodes", fmt=_text),
    ETA,
    ("acceptance per depth", _acceptance),
    TPS,
    SPEEDUP,
]
EXP2_COLUMNS = [_col("B", "nodes", fmt=_text), LABEL, _col("depth", "depth", fmt=_text), ETA, TPS, SPEEDUP]
MCSD_COLUMNS = [
    LABEL,
    _col("k", "k", fmt=_text),
    _col("depth", "depth", fmt=_text),
    _col("nodes", "nodes", fmt=_text),
    _col("α", "alpha"),
    ETA,
    TPS,
    SPEEDUP,
]
MTAD_COLUMNS = [
    ("T", lambda r: f"{r.get('temperature') or 0.0:g}"),
    LABEL,
    ETA,
    TPS,
    SPEEDUP,
    _col("perplexity", "perplexity"),
]
SCALING_COLUMNS = [
    _col("concurrency", "concurrency", fmt=_text),
    LABEL,
    _col("aggregate tok/s", "tokens_per_second"),
    _col("token latency p50 / p95 ms", "token_latency_p50_ms", "token_latency_p95_ms", fmt=_ms),
    _col("TTFT p50 / p95 ms", "ttft_p50_ms", "ttft_p95_ms", fmt=_ms),
    ETA,
]


DEFAULT_COLUMNS = [
    LABEL,
    _col("via", "via", fmt=_text),
    TPS,
    _col("vs llama-server", "vs_llama_server", fmt=_x),
    _col("vs hf assisted", "vs_hf_assisted", fmt=_x),
    _col("vs none", "speedup", fmt=_x),
    ETA,
]
DEFAULT_SCALING_COLUMNS = [
    _col("concurrency", "concurrency", fmt=_text),
    LABEL,
    _col("aggregate tok/s", "tokens_per_second"),
    _col("vs none", "speedup", fmt=_x),
    _col("token latency p50 / p95 ms", "token_latency_p50_ms", "token_latency_p95_ms", fmt=_ms),
    ETA,
]


_META_KEYS = ("machine", "cpu", "threads", "dtype", "draft_dtype", "date", "torch", "transformers")
_META_KEYS += ("prompts", "max_new_tokens", "sweep_prompts", "sweep_max_new_tokens")


def _meta_section(meta: dict) -> list[str]:
    m = {k: _text(meta.get(k)) for k in _META_KEYS}
    draft, target = (meta.get("pair") or [None, None])[:2]
    seconds = meta.get("seconds")
    wall = DASH if seconds is None else f"{seconds:.0f} s ({seconds / 60:.1f} min)"
    return [
        "# Benchmarks",
        "",
        "Only ratios measured within this one run are reported (speedups are against the autoregressive "
        "row of the same run); absolute tokens/s depend on the machine.",
        "",
        f"- Machine: {m['machine']} ({m['cpu']}), {m['threads']} threads",
        f"- Target dtype: {m['dtype']}; draft dtype: {m['draft_dtype']}",
        f"- Pair: draft `{_text(draft)}` → target `{_text(target)}`",
        f"- Date: {m['date']}; torch {m['torch']}, transformers {m['transformers']}",
        f"- Headline, baseline, scaling: {m['prompts']} prompts × {m['max_new_tokens']} new tokens",
        f"- Sweeps (Exp1, Exp2, MCSD, MTAD): {m['sweep_prompts']} prompts × "
        f"{m['sweep_max_new_tokens']} new tokens",
        f"- Wall time of the last run (phases {_text(', '.join(meta.get('phases_run') or []))}): {wall}",
        "- Measured: " + (", ".join(f"{k} {v}" for k, v in (meta.get("measured") or {}).items()) or DASH),
        "",
        "Regenerate with:",
        "",
        "```bash",
        meta.get("command") or "",
        "```",
    ]


def _goals_section(goals: list[dict]) -> list[str]:
    met = {True: "✅", False: "❌", None: DASH}
    columns = [
        _col("name", "name", fmt=_text),
        _col("goal", "target"),
        _col("measured", "measured"),
        ("met", lambda g: met.get(g.get("met"), DASH)),
        _col("detail", "detail", fmt=_text),
    ]
    return ["## Goals", "", *_rows_table(columns, goals)]


def _per_temperature(title: str, columns: list[Column], rows: list[dict], sort=None) -> list[str]:
    """The section heading and one table per temperature."""
    lines = [title]
    for t, group in _by_temperature(rows):
        table = _rows_table(columns, sorted(group, key=sort) if sort else group)
        lines += ["", f"### {_temp(t)}", "", *table]
    return lines


def _headline_section(rows: list[dict], out_dir: pathlib.Path) -> list[str]:
    rows = sorted(rows, key=lambda r: r.get("experiment") != "baseline")  # baseline rows lead each table
    lines = _per_temperature("## Headline: through the gateway", HEADLINE_COLUMNS, rows)
    groups = []  # (temperature, {label: tok/s}), rows without a measurement left out
    for t, group in _by_temperature(rows):
        tps = {r.get("label") or "?": r.get("tokens_per_second") for r in group}
        groups.append((_temp(t), {label: v for label, v in tps.items() if v is not None}))
    return lines + _image("Headline tokens/s", _bar_plot(groups, "tokens/s", out_dir / "headline.png"))


def _sweep_section(rows: list[dict], out_dir: pathlib.Path, exp: str) -> list[str]:
    """Exp1 (fixed depth L) and Exp2 (fixed node budget B): the same sweep seen along another x axis."""
    title, x_key, x_name, columns = {
        "exp1": ("## Exp1: fixed depth L", "depth", "L", EXP1_COLUMNS),
        "exp2": ("## Exp2: fixed node budget B", "nodes", "B", EXP2_COLUMNS),
    }[exp]
    lines = _per_temperature(title, columns, rows, sort=lambda r: (_key(r.get(x_key)), r.get("label") or ""))
    for y_key, y_name, suffix in (("block_efficiency", "η", ""), ("speedup", "speedup", "_speedup")):
        panels = [
            (_temp(t), y_name, _best_by_family(group, x_key, y_key)) for t, group in _by_temperature(rows)
        ]
        name = _line_plot(panels, x_name, out_dir / f"{exp}{suffix}.png")
        lines += _image(f"{exp}: best {y_name} per method vs {x_name}", name)
    return lines


def _mcsd_section(rows: list[dict], out_dir: pathlib.Path) -> list[str]:
    lines = _per_temperature("## MCSD: k = 1 vs k = 4 and the best k-config", MCSD_COLUMNS, rows)
    for t, group in _by_temperature(rows):
        # The autoregressive reference (1.00x by definition) is not a k-config.
        candidates = [r for r in group if r.get("speedup") is not None and r.get("method") != Method.NONE]
        if candidates:
            best = max(candidates, key=lambda r: r["speedup"])
            lines += [
                "",
                f"best k-config at {_temp(t)}: {_text(best.get('label'))} "
                f"({_x(best['speedup'])}, η {_fmt(best.get('block_efficiency'))})",
            ]
    return lines


def _mtad_section(rows: list[dict], out_dir: pathlib.Path) -> list[str]:
    rows = [r for _, group in _by_temperature(rows) for r in group]
    return ["## MTAD vs chain", "", *_rows_table(MTAD_COLUMNS, rows)]


def _scaling_section(rows: list[dict], out_dir: pathlib.Path) -> list[str]:
    title = "## Scaling: concurrent sessions through the gateway"
    lines = _per_temperature(
        title, SCALING_COLUMNS, rows, sort=lambda r: (_key(r.get("concurrency")), r.get("label") or "")
    )
    throughput: Series = {}
    latency: Series = {}
    for t, group in _by_temperature(rows):
        for r in sorted(group, key=lambda r: _key(r.get("concurrency"))):
            name, n = f"{r.get('label') or '?'} {_temp(t)}", r.get("concurrency")
            for series, key in ((throughput, "tokens_per_second"), (latency, "token_latency_p95_ms")):
                if n is not None and r.get(key) is not None:
                    series.setdefault(name, []).append((n, r[key]))
    panels = [("aggregate throughput", "tokens/s", throughput), ("p95 token latency", "ms", latency)]
    name = _line_plot(panels, "concurrent sessions", out_dir / "scaling.png")
    return lines + _image("Scaling with concurrent sessions", name)


def _default_section(rows: list[dict], out_dir: pathlib.Path) -> list[str]:
    lines = ["## Fast by default: `specmesh up` with no flags against what users run instead"]
    table_rows = [r for r in rows if r.get("experiment") == "default"]
    for prompt_set in sorted({r.get("prompt_set") or "?" for r in table_rows}):
        group = [r for r in table_rows if (r.get("prompt_set") or "?") == prompt_set]
        lines += ["", *_per_temperature(f"### prompts: {prompt_set}", DEFAULT_COLUMNS, group)]
    scaling = [r for r in rows if r.get("experiment") == "default_scaling"]
    if scaling:
        sort = lambda r: (_key(r.get("concurrency")), r.get("label") or "")  # noqa: E731
        lines += ["", *_per_temperature("### default vs none, concurrent streams", DEFAULT_SCALING_COLUMNS,
                                        scaling, sort=sort)]  # fmt: skip
    return lines


# (experiments shown, section writer), in report order
_SECTIONS: list[tuple[tuple[str, ...], Callable[[list[dict], pathlib.Path], list[str]]]] = [
    (("default", "default_scaling"), _default_section),
    (("baseline", "headline"), _headline_section),
    (("exp1",), lambda rows, out: _sweep_section(rows, out, "exp1")),
    (("exp2",), lambda rows, out: _sweep_section(rows, out, "exp2")),
    (("mcsd",), _mcsd_section),
    (("mtad",), _mtad_section),
    (("scaling",), _scaling_section),
]


def write_report(results: dict, out_dir: pathlib.Path) -> pathlib.Path:
    """Write out_dir/README.md and out_dir/*.png from `results`; return the README path.
    out_dir/notes.md, if present, is included after the goals."""
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = _meta_section(results.get("meta") or {})
    if results.get("goals"):
        lines += ["", *_goals_section(results["goals"])]
    notes = out_dir / "notes.md"  # hand-written reading of the numbers, kept across regenerations
    if notes.exists():
        lines += ["", notes.read_text(encoding="utf-8").strip()]
    all_rows = results.get("rows") or []
    for experiments, section in _SECTIONS:
        rows = [r for r in all_rows if r.get("experiment") in experiments]
        if rows:
            lines += ["", *section(rows, out_dir)]
    readme = out_dir / "README.md"
    readme.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return readme
