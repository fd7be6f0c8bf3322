"""Agentic traffic on a running stack: requests made from a few templates whose answers share their
structure (JSON records, SQL statements, Python dataclasses, tool calls), as agents and services
send them. Method `suffix` (docs/gateway.md, "Suffix drafts") drafts from the outputs of every
finished session of the mesh, so it should gain as the stream goes on; it is measured against
method `none` (plain decoding), method `ngram` (depth 4: the session's own n-grams only) and the
default (no speculation field), on the same prompts and seeds.

    specmesh up --no-demo &     # a freshly started stack, then:
    specmesh bench agentic --json docs/benchmarks/agentic.json

Fairness: every request of `none`, `ngram` and the default is sent `private`, so that its output
teaches no suffix drafter (at temperature 0 the `none` answer to a prompt would otherwise be the
exact answer the suffix engine is then asked for). Only the suffix engine's requests teach, one
another: what the benchmark is about. One session at a time, prompt i runs on the private
engines (their order rotated each prompt, as `default_path.interleaved`) and then on `suffix`;
at 4 and 8 sessions each engine runs all the row's prompts in turn, `suffix` last. Every row has
prompts of its own (the templates with fresh values), so the suffix drafters never saw the
answer to a prompt they are asked, only those of its siblings.

Run it on a freshly started stack: the drafters keep what they learnt (and the outputs log in
Redis replays it to a restarted drafter) for the stack's life, so a second run starts from what
the first one taught them. The one-session row also reports the suffix engine's acceptance over
the first half of its prompts against the second half: the mesh learning.
"""

from __future__ import annotations

import functools
import random
import time

from specmesh.bench.default_path import FIRST_SEED, Engine, gateway_run, ratios, summed, with_rates
from specmesh.bench.measure import render_chat
from specmesh.core.drafting import TreeSpec
from specmesh.core.methods import Method

# What agents send: one question per template, filled with different values each time. The
# answers share their skeleton (keys, keywords, decorators, the call's shape): what suffix drafts
# learn from one answer and propose for the next.
TEMPLATES: dict[str, str] = {
    "customer_json": (
        "Write a JSON object for a customer with fields name, age, city, email, plan. The customer is "
        "{name}, {age}, lives in {city}, email {email}, on the {plan} plan. Answer with the JSON only."
    ),
    "sql_query": (
        "Write a SQL query that selects {cols} from the table {table} where {col} is greater than {n}, "
        "ordered by {col2}. Answer with the SQL only."
    ),
    "dataclass": (
        "Write a Python dataclass named {name} with fields {fields} and their types. "
        "Answer with the code only."
    ),
    "tool_call": (
        "Call the tool get_weather for {city} on {date}: answer with the tool call as JSON "
        '{{"name": "get_weather", "arguments": {{...}}}} only.'
    ),
}

FIRST_NAMES = ("Alice", "Bruno", "Chen", "Dana", "Elif", "Farid", "Grace", "Hiro",
               "Ines", "Jonas", "Kemi", "Lars", "Maya", "Nikolai", "Olga", "Priya")  # fmt: skip
LAST_NAMES = ("Martin", "Okafor", "Novak", "Silva", "Larsen", "Tanaka", "Rossi", "Kowalski",
              "Haddad", "Moreau", "Schmidt", "Ng")  # fmt: skip
CITIES = ("Lisbon", "Nairobi", "Osaka", "Toronto", "Krakow", "Lyon", "Austin", "Bergen",
          "Cordoba", "Hanoi", "Tbilisi", "Adelaide", "Porto", "Utrecht", "Quito", "Seoul")  # fmt: skip
PLANS = ("free", "basic", "pro", "team", "enterprise")
# table -> (its other columns, its numeric columns)
TABLES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "orders": (("id", "customer_id", "status", "created_at"), ("total", "quantity")),
    "employees": (("id", "name", "department", "hired_on"), ("salary", "age")),
    "products": (("sku", "name", "category", "supplier"), ("price", "stock")),
    "flights": (("code", "origin", "destination", "departs_at"), ("seats_left", "distance_km")),
    "sensors": (("id", "location", "kind", "installed_on"), ("temperature", "battery")),
    "invoices": (("number", "client", "issued_on", "currency"), ("amount", "days_overdue")),
}
CLASS_NAMES = ("Invoice", "Shipment", "UserProfile", "Sensor", "Booking", "Article",
               "Vehicle", "Ticket", "Recipe", "Course", "Warehouse", "Payment")  # fmt: skip
FIELDS = ("id", "name", "email", "price", "quantity", "created_at", "tags", "active",
          "owner", "weight", "rating", "notes")  # fmt: skip


def _customer(rng: random.Random) -> dict:
    first, last = rng.choice(FIRST_NAMES), rng.choice(LAST_NAMES)
    return dict(
        name=f"{first} {last}", age=rng.randint(19, 78), city=rng.choice(CITIES),
        email=f"{first.lower()}.{last.lower()}@example.com", plan=rng.choice(PLANS),
    )  # fmt: skip


def _sql(rng: random.Random) -> dict:
    table = rng.choice(sorted(TABLES))
    others, numbers = TABLES[table]
    columns = others + numbers
    return dict(
        cols=", ".join(rng.sample(columns, rng.randint(2, 3))), table=table, col=rng.choice(numbers),
        n=rng.randint(2, 999), col2=rng.choice(columns),
    )  # fmt: skip


def _dataclass(rng: random.Random) -> dict:
    return dict(name=rng.choice(CLASS_NAMES), fields=", ".join(rng.sample(FIELDS, rng.randint(3, 5))))


def _tool_call(rng: random.Random) -> dict:
    return dict(city=rng.choice(CITIES), date=f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}")


VALUES = {"customer_json": _customer, "sql_query": _sql, "dataclass": _dataclass, "tool_call": _tool_call}


def agentic_messages(n: int, offset: int = 0) -> list[str]:
    """n user messages, the templates in turn (message i from TEMPLATES' (i mod 4)-th), each filled
    with values drawn from a generator seeded by offset + i: deterministic, and another offset
    gives fresh values."""
    names = list(TEMPLATES)
    out = []
    for i in range(n):
        name = names[i % len(names)]
        out.append(TEMPLATES[name].format(**VALUES[name](random.Random(f"agentic {offset + i}"))))
    return out


def agentic_prompts(n: int, tokenizer, offset: int = 0) -> list[str]:
    """agentic_messages as user messages in the model's chat template, ready for the answer."""
    return render_chat(agentic_messages(n, offset), tokenizer)


# engine -> (its speculation field, None for none; private). Only suffix teaches (the docstring).
TEACHER = "suffix"
ENGINES: dict[str, tuple[TreeSpec | None, bool]] = {
    "none": (TreeSpec(Method.NONE), True),
    "ngram": (TreeSpec(Method.NGRAM, depth=4), True),
    "default": (None, True),
    TEACHER: (TreeSpec(Method.SUFFIX, depth=8, beam_width=2), False),  # the gateway's defaults
}
PAIRS = (("suffix", "none"), ("suffix", "ngram"), ("default", "none"), ("default", "ngram"))


def _gateway_run(
    address: str, spec: TreeSpec | None, private: bool, temperature: float, max_new: int, sessions: int,
    texts: list[str], first_seed: int,
) -> dict:  # fmt: skip
    return gateway_run(address, texts, spec, temperature, max_new, sessions, first_seed, private)


def learning_order(engines: dict[str, Engine], texts: list[str], teacher: str = TEACHER) -> dict[str, list]:
    """Prompt i (seed FIRST_SEED + i) on every engine but the teacher, their order rotated by one
    each prompt, then on the teacher: its requests never run before the private ones of the same
    prompt. -> per engine, its per-prompt measurements in prompt order."""
    names = [name for name in engines if name != teacher]
    parts: dict[str, list[dict]] = {name: [] for name in engines}
    for i, text in enumerate(texts):
        k = i % len(names) if names else 0
        for name in [*names[k:], *names[:k], *([teacher] if teacher in engines else [])]:
            parts[name].append(engines[name]([text], FIRST_SEED + i))
    return parts


def halves(parts: list[dict]) -> list[dict]:
    """An engine's prompts in two halves, in the order they ran (the templates in the same mix in
    each): accepted / drafted tokens, and accepted per generated token, in each. For the suffix
    engine the second half's should be higher: the drafters learnt from the first."""
    half = len(parts) // 2
    out = []
    for chunk in (parts[:half], parts[half:]):
        drafted = sum(p["drafted_tokens"] for p in chunk)
        accepted = sum(p["accepted_tokens"] for p in chunk)
        tokens = sum(p["tokens"] for p in chunk)
        acceptance = accepted / drafted if drafted else None
        per_token = accepted / tokens if tokens else None
        out.append(dict(prompts=len(chunk), drafted_tokens=drafted, accepted_tokens=accepted,
                        acceptance=acceptance, accepted_per_token=per_token))  # fmt: skip
    return out


def engine_ratios(row: dict) -> dict:
    """suffix and the default over none and ngram, whole requests and decode phase (PAIRS)."""
    out: dict = {}
    for engine, base in PAIRS:
        if engine in row and base in row:
            out.update(ratios(row[engine], row[base], base, engine))
    return out


def compare(address: str, texts: list[str], temperature: float, max_new: int, sessions: int) -> dict:
    """Every engine of ENGINES on the same texts and seeds, `sessions` streams at a time: one
    session in `learning_order`, else each engine's batches in turn (the teacher last)."""
    engines: dict[str, Engine] = {
        name: functools.partial(_gateway_run, address, spec, private, temperature, max_new, sessions)
        for name, (spec, private) in ENGINES.items()
    }
    learning: dict = {}
    if sessions == 1:
        parts = learning_order(engines, texts)
        measured = {name: summed(p) for name, p in parts.items()}
        learning["suffix_halves"] = halves(parts[TEACHER])
    else:
        measured = {name: summed([run(texts, FIRST_SEED)]) for name, run in engines.items()}
    row = {name: with_rates(m) for name, m in measured.items()}
    return {**row, **engine_ratios(row), **learning}


def bench_agentic(
    address: str,
    prompts: int = 24,
    max_new: int = 96,
    temperatures: tuple[float, ...] = (0.0,),
    sessions: tuple[int, ...] = (1, 4, 8),
    target: str = "default-target",
) -> dict:
    """A row per temperature and session count, in that order (the one-session row first by
    default), each on `prompts` prompts of its own (offset: the rows before it x prompts)."""
    from specmesh.runtime.tokenizers import gguf_file, load_tokenizer

    tokenizer, _ = load_tokenizer(gguf_file(target) or target)
    rows = []
    for temperature in temperatures:
        for s in sessions:
            offset = len(rows) * prompts
            texts = agentic_prompts(prompts, tokenizer, offset)
            measured = compare(address, texts, temperature, max_new, s)
            row = dict(set="agentic", temperature=temperature, sessions=s, offset=offset, **measured)
            rows.append(row)
            _print(row)
    engines = {name: dict(spec=repr(spec), private=private) for name, (spec, private) in ENGINES.items()}
    return dict(
        address=address, date=time.strftime("%Y-%m-%d %H:%M:%S"), prompts=prompts, max_new_tokens=max_new,
        templates=TEMPLATES, engines=engines, rows=rows,
    )  # fmt: skip


def _print(row: dict) -> None:
    """A row's rates, whole requests then (in brackets) the decode phase; the ratios; each engine's
    drafts; in the one-session row, the suffix engine's acceptance per half."""

    def rate(engine: dict) -> str:
        decode = engine.get("decode_tokens_per_second")
        whole = f"{engine['tokens_per_second']:6.2f}"
        return f"{whole} ({decode:6.2f})" if decode else whole

    head = f"{row['set']:<7} T={row['temperature']:<3} sessions={row['sessions']}"
    rates = "".join(f"  {name} {rate(row[name])}" for name in ENGINES if name in row)
    vs = "".join(
        f"  x{row[k]:.2f} ({row.get('decode_' + k, float('nan')):.2f}) {k.replace('_over_', '/')}"
        for k in (f"{engine}_over_{base}" for engine, base in PAIRS)
        if k in row
    )
    drafts = "".join(
        f"  {name} {row[name]['drafted_tokens']}/{row[name]['accepted_tokens']} "
        f"({row[name]['block_efficiency'] or 0:.2f})"
        for name in ENGINES
        if name in row and name != "none"
    )
    lines = [f"{head} tok/s{rates}", f"  {vs}", f"    drafted/accepted (block efficiency):{drafts}"]
    if "suffix_halves" in row:
        first, second = row["suffix_halves"]
        lines.append(
            f"    suffix acceptance: first half {first['acceptance'] or 0:.2f} "
            f"({first['accepted_per_token'] or 0:.2f}/token), second half "
            f"{second['acceptance'] or 0:.2f} ({second['accepted_per_token'] or 0:.2f}/token)"
        )
    print("\n".join(lines), flush=True)
