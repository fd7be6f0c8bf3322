"""The broad copy set: 32 prompts of 8 kinds whose answers mostly copy their context.

The per-round policy that decides n-gram and suffix drafts was tuned on `edit`, `quote` and
`rewrite` (measure.py): three kinds of copying. This set is broader: 4 prompts of each of 8
kinds, a Python function with a variable renamed (`rename`), a text with one word replaced
(`replace`), a class given type hints (`hints`), a text with its one misspelling corrected
(`typo`), JSON converted to YAML (`yaml`), a CSV table converted to Markdown (`markdown`), lines
sorted (`sort`) and a function given a docstring (`docstring`). Each context is 100-600 tokens.

It was written before any tuning on it, and it is split in two halves: within each kind, the
prompts at even indices are the tuning half (`copy`), those at odd indices the held-out half
(`copy-held`). Tune on `copy` only; what a report quotes for this set is `copy-held`.

Everything is deterministic and offline: the texts are the running Python's standard library
(its module docstrings and function sources, PSF licence, as `passage` reads them; another
Python version may give other texts), four small classes written here, and tables and JSON
documents drawn from `random.Random(seed)` with fixed seeds.
"""

from __future__ import annotations

import ast
import csv
import importlib
import inspect
import io
import json
import random
import re
import textwrap
from dataclasses import dataclass

KINDS = ("rename", "replace", "hints", "typo", "yaml", "markdown", "sort", "docstring")
PARTS = {"all": (0, 1, 2, 3), "tuning": (0, 2), "held-out": (1, 3)}  # indices within a kind


@dataclass(frozen=True)
class CopyPrompt:
    """One prompt: its kind, where its text came from, the user message and the context its answer
    copies. subject: what the instruction names, per kind: rename (old name, new name), replace
    (word, replacement), hints (class), typo (module, word, misspelling, its offset in context),
    docstring (function); none for yaml, markdown and sort."""

    kind: str
    source: str
    message: str
    context: str
    subject: tuple[str, ...] = ()


def passage(module: str, limit: int = 1600) -> str:
    """A module's docstring, its whole paragraphs up to `limit` characters (at least one)."""
    paragraphs = (inspect.getdoc(importlib.import_module(module)) or "").split("\n\n")
    kept = [paragraphs[0]]
    for p in paragraphs[1:]:
        if sum(len(k) + 2 for k in kept) + len(p) > limit:
            break
        kept.append(p)
    return "\n\n".join(kept)


def function_source(path: str, strip_docstring: bool = False) -> str:
    """A standard-library function's source ("module.function"), dedented; strip_docstring:
    without its docstring, if it has one."""
    module, name = path.rsplit(".", 1)
    source = textwrap.dedent(inspect.getsource(getattr(importlib.import_module(module), name)))
    body = ast.parse(source).body[0].body  # type: ignore[attr-defined]
    if strip_docstring and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        lines = source.splitlines(keepends=True)
        source = "".join(lines[: body[0].lineno - 1] + lines[body[0].end_lineno :])
    return source


# kind 1: a variable renamed in a function of 15-50 lines
RENAMES = (
    ("textwrap.dedent", "margin", "common_margin"),
    ("heapq._siftup", "childpos", "child_index"),
    ("getopt.long_has_args", "possibilities", "candidates"),
    ("colorsys.rgb_to_hls", "maxc", "max_channel"),
)


def rename_prompts() -> list[CopyPrompt]:
    out = []
    for path, old, new in RENAMES:
        source = function_source(path)
        message = (
            f"Rename the variable `{old}` to `{new}` everywhere in this Python function. "
            f"Output the complete modified function only.\n\n```python\n{source}```"
        )
        out.append(CopyPrompt("rename", path, message, source, (old, new)))
    return out


# kind 2: one word replaced in a module docstring (modules used by neither quote nor rewrite)
REPLACES = (
    ("io", "stream", "channel"),
    ("shelve", "data", "payload"),
    ("urllib.request", "object", "item"),
    ("cmd", "command", "directive"),
)


def replace_prompts() -> list[CopyPrompt]:
    out = []
    for module, word, new in REPLACES:
        text = passage(module)
        message = (
            f'Replace every occurrence of the word "{word}" with "{new}" in the following text '
            "(whole words only). Output the complete text with that change and nothing else.\n\n"
            f"{text}"
        )
        out.append(CopyPrompt("replace", f"passage:{module}", message, text, (word, new)))
    return out


# kind 3: four small untyped classes, written for this set
CLASSES = (
    """class LRUCache:
    def __init__(self, capacity):
        self.capacity = capacity
        self._items = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key, default=None):
        if key not in self._items:
            self.misses += 1
            return default
        self.hits += 1
        self._items.move_to_end(key)
        return self._items[key]

    def put(self, key, value):
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def hit_rate(self):
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def __len__(self):
        return len(self._items)
""",
    """class Inventory:
    def __init__(self, owner):
        self.owner = owner
        self.items = {}
        self.prices = {}

    def add(self, name, quantity, price):
        self.items[name] = self.items.get(name, 0) + quantity
        self.prices[name] = price

    def remove(self, name, quantity=1):
        if self.items.get(name, 0) < quantity:
            raise ValueError(f"not enough {name} in stock")
        self.items[name] -= quantity
        if self.items[name] == 0:
            del self.items[name]

    def total_value(self):
        return sum(count * self.prices[name] for name, count in self.items.items())

    def low_stock(self, threshold=5):
        return sorted(name for name, count in self.items.items() if count < threshold)

    def describe(self):
        lines = [f"{name}: {count} x {self.prices[name]:.2f}" for name, count in sorted(self.items.items())]
        return "\\n".join([f"Inventory of {self.owner}", *lines])
""",
    """class TokenBucket:
    def __init__(self, rate, capacity, now=0.0):
        self.rate = rate
        self.capacity = capacity
        self.tokens = capacity
        self.updated = now

    def _refill(self, now):
        elapsed = max(0.0, now - self.updated)
        self.tokens = min(self.capacity, self.tokens + elapsed * self.rate)
        self.updated = now

    def allow(self, now, cost=1):
        self._refill(now)
        if self.tokens >= cost:
            self.tokens -= cost
            return True
        return False

    def wait_time(self, now, cost=1):
        self._refill(now)
        missing = cost - self.tokens
        return max(0.0, missing / self.rate)

    def __repr__(self):
        return f"TokenBucket(rate={self.rate}, capacity={self.capacity}, tokens={self.tokens:.1f})"
""",
    """class Interval:
    def __init__(self, start, end):
        if end < start:
            raise ValueError("an interval ends after it starts")
        self.start = start
        self.end = end

    def length(self):
        return self.end - self.start

    def contains(self, point):
        return self.start <= point < self.end

    def overlaps(self, other):
        return self.start < other.end and other.start < self.end

    def merge(self, other):
        if not self.overlaps(other) and self.end != other.start and other.end != self.start:
            raise ValueError("only touching or overlapping intervals merge")
        return Interval(min(self.start, other.start), max(self.end, other.end))

    def split(self, point):
        if not self.contains(point) or point == self.start:
            return [self]
        return [Interval(self.start, point), Interval(point, self.end)]

    def __repr__(self):
        return f"Interval({self.start}, {self.end})"
""",
)


def hints_prompts() -> list[CopyPrompt]:
    out = []
    for source in CLASSES:
        name = source.split()[1].rstrip(":")
        message = (
            "Add type hints to every method of this Python class, its parameters and its return "
            "type. Change nothing else. Output the complete class only.\n\n"
            f"```python\n{source}```"
        )
        out.append(CopyPrompt("hints", f"class:{name}", message, source, (name,)))
    return out


# kind 4: one misspelling to correct in a module docstring (modules used nowhere else)
TYPO_MODULES = ("pyclbr", "fileinput", "tokenize", "tempfile")


def misspelt(text: str) -> tuple[str, str, str, int]:
    """The text with one word misspelt: of the words of 8 letters or more in its prose lines (not
    indented), the middle one whose third and fourth letters differ, those two swapped.
    -> (text, the word, its misspelling, its offset)."""
    words, offset = [], 0
    for line in text.splitlines(keepends=True):
        if line[:1].isalpha():
            found = re.finditer(r"(?<= )[a-z]{8,}(?=[ ,.;])", line)
            words += [(offset + m.start(), m.group()) for m in found]
        offset += len(line)
    middle = len(words) // 2
    for at, word in words[middle:] + words[:middle]:
        if word[2] != word[3]:
            wrong = word[:2] + word[3] + word[2] + word[4:]
            return text[:at] + wrong + text[at + len(word) :], word, wrong, at
    raise ValueError("no word to misspell")


def typo_prompts() -> list[CopyPrompt]:
    out = []
    for module in TYPO_MODULES:
        text, word, wrong, at = misspelt(passage(module))
        message = (
            "The following text contains exactly one misspelt word. Output the complete text with "
            f"that spelling mistake corrected and nothing else changed.\n\n{text}"
        )
        out.append(CopyPrompt("typo", f"passage:{module}", message, text, (module, word, wrong, str(at))))
    return out


# kind 5: JSON documents to convert to YAML
JSON_KEYS = (
    "name", "owner", "region", "zone", "version", "timeout", "retries", "enabled", "debug", "port",
    "host", "protocol", "threshold", "ratio", "priority", "label", "color", "mode", "level", "path",
    "limit", "window", "budget", "interval", "capacity", "weight", "origin", "target", "format",
    "language", "schedule", "quota",
)  # fmt: skip
WORDS = (
    "amber", "basalt", "cedar", "delta", "ember", "fjord", "garnet", "harbor", "indigo", "juniper",
    "kestrel", "lagoon", "meadow", "nimbus", "orchid", "pebble", "quartz", "raven", "saffron",
    "tundra", "umber", "violet", "willow", "zephyr",
)  # fmt: skip
JSON_SEEDS = (11, 12, 13, 14)


def _scalar(rng: random.Random) -> object:
    kind = rng.randrange(5)
    if kind == 0:
        return rng.randint(1, 9999)
    if kind == 1:
        return round(rng.uniform(0, 100), 2)
    if kind == 2:
        return rng.random() < 0.5
    if kind == 3:
        return rng.choice(WORDS)
    return f"{rng.choice(WORDS)}-{rng.choice(WORDS)}-{rng.randint(1, 99)}"


def json_document(seed: int) -> dict:
    """A nested object of 18-24 keys: 4-6 scalars, two objects of 3-5 scalars, a list of words
    and a list of two small objects."""
    rng = random.Random(seed)
    keys = iter(rng.sample(JSON_KEYS, len(JSON_KEYS)))
    doc: dict = {next(keys): _scalar(rng) for _ in range(rng.randint(4, 6))}
    for _ in range(2):
        doc[next(keys)] = {next(keys): _scalar(rng) for _ in range(rng.randint(3, 5))}
    doc[next(keys)] = rng.sample(WORDS, rng.randint(3, 5))
    doc[next(keys)] = [{"id": rng.randint(100, 999), "label": rng.choice(WORDS)} for _ in range(2)]
    return doc


def yaml_prompts() -> list[CopyPrompt]:
    out = []
    for seed in JSON_SEEDS:
        text = json.dumps(json_document(seed), indent=2)
        message = (
            "Convert this JSON document to YAML, keeping the keys in the same order. "
            f"Output the YAML only.\n\n```json\n{text}\n```"
        )
        out.append(CopyPrompt("yaml", f"seed:{seed}", message, text))
    return out


# kind 6: CSV tables to convert to Markdown
FIRST = ("Ada", "Bruno", "Chen", "Dara", "Emil", "Farah", "Goran", "Hana", "Ivo", "Jun", "Kofi", "Lena")
LAST = ("Alvarez", "Berg", "Costa", "Dubois", "Eriksen", "Fischer", "Gupta", "Haddad", "Ito", "Jensen")
CITIES = ("Lisbon", "Oslo", "Nairobi", "Osaka", "Lima", "Toronto", "Krakow", "Hanoi", "Dublin", "Porto")


def _date(rng: random.Random) -> str:
    return f"20{rng.randint(10, 24)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"


def _employee(rng: random.Random, i: int) -> list[object]:
    person = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
    department = rng.choice(("Sales", "Research", "Support", "Finance", "Legal"))
    return [f"E{1001 + i}", person, department, rng.choice(CITIES), rng.randint(38, 140) * 1000, _date(rng)]


def _product(rng: random.Random, i: int) -> list[object]:
    product = f"{rng.choice(WORDS).title()} {rng.choice(('lamp', 'chair', 'kettle', 'desk', 'rug'))}"
    category = rng.choice(("home", "office", "kitchen", "garden"))
    price = f"{rng.uniform(5, 400):.2f}"
    return [f"SKU-{rng.randint(10000, 99999)}", product, category, price, rng.randint(0, 250)]


def _flight(rng: random.Random, i: int) -> list[object]:
    number = f"{rng.choice(('SK', 'TP', 'KQ', 'JL'))}{rng.randint(100, 999)}"
    origin, destination = rng.sample(CITIES, 2)
    departure = f"{rng.randint(5, 23):02d}:{rng.choice((0, 15, 30, 45)):02d}"
    gate = f"{rng.choice('ABCD')}{rng.randint(1, 30)}"
    status = rng.choice(("on time", "delayed", "boarding", "cancelled"))
    return [number, origin, destination, departure, gate, status]


def _reading(rng: random.Random, i: int) -> list[object]:
    station = f"{rng.choice(WORDS)}-{rng.randint(1, 9)}"
    return [station, _date(rng), f"{rng.uniform(-10, 35):.1f}", rng.randint(20, 100), rng.randint(0, 80)]


TABLES = {
    "employees": (("id", "name", "department", "city", "salary", "start_date"), _employee),
    "products": (("sku", "product", "category", "price", "stock"), _product),
    "flights": (("flight", "from", "to", "departure", "gate", "status"), _flight),
    "weather": (("station", "date", "temperature_c", "humidity_pct", "wind_kmh"), _reading),
}


def table(name: str, seed: int) -> list[list[str]]:
    """A header and 10-14 rows of one of TABLES, drawn with `seed`."""
    rng = random.Random(seed)
    header, row = TABLES[name]
    return [list(header), *([str(v) for v in row(rng, i)] for i in range(rng.randint(10, 14)))]


def markdown_prompts() -> list[CopyPrompt]:
    out = []
    for seed, name in enumerate(TABLES, start=21):
        buffer = io.StringIO()
        csv.writer(buffer, lineterminator="\n").writerows(table(name, seed))
        text = buffer.getvalue()
        message = (
            "Convert this CSV table to a Markdown table, keeping every row and column in order. "
            f"Output the Markdown table only.\n\n```csv\n{text}```"
        )
        out.append(CopyPrompt("markdown", f"table:{name}:{seed}", message, text))
    return out


# kind 7: lines to sort, the signatures of a module's (or str's) public functions
SORT_SOURCES = ("shutil", "urllib.parse", "base64", "str")


def signatures(source: str) -> list[str]:
    """`source.function(signature)` of its public functions (methods, for "str") whose signature
    shows no object's address, in their order of definition."""
    if source == "str":
        members = {name: getattr(str, name) for name in vars(str) if not name.startswith("_")}
    else:
        module = importlib.import_module(source)
        members = {
            name: f
            for name, f in vars(module).items()
            if inspect.isfunction(f) and f.__module__ == source and not name.startswith("_")
        }
    out = []
    for name, f in members.items():
        try:
            line = f"{source}.{name}{inspect.signature(f)}"
        except ValueError:  # a builtin without a text signature
            continue
        if "<" not in line:
            out.append(line)
    return out


def sort_prompts() -> list[CopyPrompt]:
    out = []
    for seed, source in enumerate(SORT_SOURCES, start=31):
        rng = random.Random(seed)
        lines = sorted(signatures(source))
        if len(lines) > 28:
            lines = rng.sample(lines, 24)
        while lines == sorted(lines):
            rng.shuffle(lines)
        text = "\n".join(lines) + "\n"
        message = (
            "Sort the following lines alphabetically. Output the complete sorted list, one line "
            f"each, and nothing else.\n\n{text}"
        )
        out.append(CopyPrompt("sort", f"signatures:{source}", message, text))
    return out


# kind 8: a docstring to add to a function of 10-30 lines (modules other than kind 1's)
DOCSTRINGS = ("base64._85encode", "mimetypes.init", "shutil._rmtree_unsafe", "locale._localize")


def docstring_prompts() -> list[CopyPrompt]:
    out = []
    for path in DOCSTRINGS:
        source = function_source(path, strip_docstring=True)
        message = (
            "Add a docstring to this Python function that says what it does. Change nothing else. "
            f"Output the complete function with its docstring only.\n\n```python\n{source}```"
        )
        out.append(CopyPrompt("docstring", path, message, source, (path.rsplit(".", 1)[1],)))
    return out


BUILDERS = (  # in the order of KINDS
    rename_prompts, replace_prompts, hints_prompts, typo_prompts, yaml_prompts, markdown_prompts,
    sort_prompts, docstring_prompts,
)  # fmt: skip


def copy_set(part: str = "all") -> list[CopyPrompt]:
    """A part's prompts ("all", "tuning" or "held-out"), the kinds round-robin: each kind's first
    prompt of the part, then each kind's second, ... so the first n cover min(n, 8) kinds."""
    if part not in PARTS:
        raise ValueError(f"unknown part {part!r}; use one of {', '.join(PARTS)}")
    by_kind = [build() for build in BUILDERS]
    return [prompts[i] for i in PARTS[part] for prompts in by_kind]


def copy_prompts(n: int, part: str = "all") -> list[str]:
    """The first n user messages of a part of the copy set (fewer if the part has fewer)."""
    return [p.message for p in copy_set(part)[:n]]
