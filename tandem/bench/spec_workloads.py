"""Chat requests for `tandem bench spec`, made so a model's greedy output is of one kind.

Three kinds, the outputs speculative decoding meets in agent traffic:

- ``tool``: tool-call JSON. A system prompt lists the tools as JSON schemas, two example
  turns answer with one JSON call each, and the last user turn asks for another call whose
  arguments are spelled out in the request (a path, a query, an address): the answer
  repeats the JSON shape of the examples and quotes the request.
- ``code``: code edits. A small Python class in the prompt, and the request to copy it with
  one change (a rename): the answer quotes most of the prompt's code.
- ``prose``: free prose. A short story or an explanation: nothing to copy.

The wording was chosen by running the default model (SmolLM2-135M-Instruct) greedily and
reading what it wrote: it answers the tool prompts with JSON objects (not always valid JSON:
a long call sometimes runs on until max_tokens), the code prompts with the class in a
```python block (mostly copied, sometimes simplified) and a sentence about it, the prose
prompts with prose. `looks_like` checks each answer for its kind, and the bench reports how
many passed, so a model that answers otherwise is seen, not assumed.

Every kind yields at least 40 distinct conversations (templates x values), so batch 32 holds
distinct requests: they share a system prompt or a few-shot prefix, as agent requests do,
but no two are the same. Torch-free.
"""

from __future__ import annotations

import json
from typing import Any

KINDS = ("tool", "code", "prose")
KIND_LABELS = {"tool": "tool-call JSON", "code": "code edits", "prose": "free prose"}

Conversation = list[dict[str, str]]

# --- tool-call JSON ---------------------------------------------------------------------------

TOOLS: list[dict[str, Any]] = [
    {"name": "get_weather", "description": "Current weather in a city",
     "parameters": {"city": "string", "unit": "celsius | fahrenheit"}},
    {"name": "read_file", "description": "Read lines of a file",
     "parameters": {"path": "string", "start_line": "integer", "end_line": "integer"}},
    {"name": "search_web", "description": "Search the web",
     "parameters": {"query": "string", "max_results": "integer"}},
    {"name": "send_email", "description": "Send an email",
     "parameters": {"to": "string", "subject": "string", "body": "string"}},
    {"name": "create_event", "description": "Add a calendar event",
     "parameters": {"title": "string", "date": "YYYY-MM-DD", "start": "HH:MM", "end": "HH:MM", "location": "string"}},
    {"name": "replace_in_file", "description": "Replace text in a file",
     "parameters": {"path": "string", "old": "string", "new": "string"}},
]
_TOOL_SYSTEM = ("You are a function-calling assistant. Answer every request with exactly one JSON tool call "
                "and nothing else.\nTools:\n" + "\n".join(json.dumps(tool) for tool in TOOLS))
_TOOL_SHOTS = [
    ("What's the weather in Paris, in celsius?",
     {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}),
    ("Email bob@example.com with subject 'Lunch' and say: Are we still on for noon tomorrow?",
     {"name": "send_email", "arguments": {"to": "bob@example.com", "subject": "Lunch",
                                          "body": "Are we still on for noon tomorrow?"}}),
    ("Show me lines 10 to 30 of src/server/app.py",
     {"name": "read_file", "arguments": {"path": "src/server/app.py", "start_line": 10, "end_line": 30}}),
]
# One request template per tool and the values it is filled with; request i uses template
# i mod 8 and that template's value set i // 8, so any 8 consecutive requests ask for 8 calls.
_TOOL_REQUESTS: list[tuple[str, list[tuple[Any, ...]]]] = [
    ("What's the weather in {}, in {}?",
     [("Berlin", "fahrenheit"), ("Lisbon", "celsius"), ("Osaka", "celsius"), ("Denver", "fahrenheit"),
      ("Nairobi", "celsius"), ("Oslo", "celsius")]),
    ("Show me lines {} to {} of {}",
     [(120, 180, "tandem/engine/scheduler.py"), (1, 45, "README.md"), (300, 360, "src/db/migrations.py"),
      (12, 20, "web/static/app.js"), (50, 99, "lib/parser/lexer.c"), (7, 70, "docs/install.md")]),
    ("Search the web for {}, {} results.",
     [("the best pizza in Naples", 5), ("how to cache pip wheels in GitHub Actions", 3),
      ("rust borrow checker tutorial", 4), ("cheap flights from Madrid to Rome", 6),
      ("python asyncio timeout example", 2), ("history of the printing press", 8)]),
    ("Email {} with subject '{}' and say: {}",
     [("alice@example.org", "Report due", "The quarterly report is due on Friday, please send your numbers by Thursday."),
      ("carol@example.com", "Invoice 4411", "Attached is invoice 4411 for March; payment is due in 30 days."),
      ("dev-team@example.net", "Deploy tonight", "We deploy version 2.3.1 at 22:00, please merge before 20:00."),
      ("sam@example.io", "Welcome", "Welcome aboard! Your laptop arrives on Monday."),
      ("ops@example.org", "Disk alert", "Server db-3 is at 91% disk usage, can someone clean the logs?"),
      ("lee@example.com", "Book club", "This month we read The Left Hand of Darkness, see you on the 12th.")]),
    ("Add an event '{}' on {} from {} to {} at {}.",
     [("Team sync", "2025-03-14", "09:30", "10:15", "Room 4B"),
      ("Dentist", "2025-04-02", "14:00", "14:45", "12 Baker Street"),
      ("Design review", "2025-05-20", "11:00", "12:30", "the main hall"),
      ("Yoga", "2025-06-01", "07:00", "08:00", "Riverside Park"),
      ("Interview", "2025-07-09", "15:00", "16:00", "Room 2A"),
      ("Dinner with Ana", "2025-08-23", "19:30", "21:30", "Casa Lisboa")]),
    ("In {} replace '{}' with '{}'",
     [("src/utils/strings.py", "def slugify(text):", "def slugify(text, sep=\"-\"):"),
      ("config/settings.yaml", "max_workers: 4", "max_workers: 16"),
      ("Makefile", "CFLAGS = -O2", "CFLAGS = -O3 -march=native"),
      ("app/models.py", "name = CharField(max_length=50)", "name = CharField(max_length=120)"),
      ("setup.cfg", "python_requires = >=3.8", "python_requires = >=3.11"),
      ("index.html", "<title>Home</title>", "<title>Welcome home</title>")]),
    ("What's the weather in {} right now, in {}?",
     [("Cairo", "celsius"), ("Chicago", "fahrenheit"), ("Reykjavik", "celsius"), ("Lima", "celsius"),
      ("Phoenix", "fahrenheit"), ("Seoul", "celsius")]),
    ("Open {} and show lines {} to {}",
     [("tests/test_api.py", 1, 60), ("server/main.go", 200, 240), ("notes/todo.txt", 1, 10),
      ("include/vector.h", 30, 90), ("scripts/deploy.sh", 5, 25), ("src/lib.rs", 400, 460)]),
]


def tool_conversations(n: int) -> list[Conversation]:
    out = []
    for i in range(n):
        template, values = _TOOL_REQUESTS[i % len(_TOOL_REQUESTS)]
        j = i // len(_TOOL_REQUESTS)
        if j >= len(values):
            raise ValueError(f"only {_capacity('tool')} distinct tool-call requests; asked for {n}")
        messages = [{"role": "system", "content": _TOOL_SYSTEM}]
        for question, call in _TOOL_SHOTS:
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": json.dumps(call)}]
        out.append(messages + [{"role": "user", "content": template.format(*values[j])}])
    return out


# --- code edits -------------------------------------------------------------------------------

_SNIPPETS: list[tuple[str, list[str]]] = [
    ('''class Counter:
    def __init__(self):
        self.count = 0

    def increment(self, step=1):
        self.count += step
        return self.count

    def reset(self):
        self.count = 0
''', ["`count` renamed to `total`", "`increment` renamed to `add`", "`step` renamed to `amount`",
      "`reset` renamed to `clear`"]),
    ('''class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        return self.items.pop()

    def is_empty(self):
        return len(self.items) == 0
''', ["`items` renamed to `elements`", "`push` renamed to `put`", "`is_empty` renamed to `empty`",
      "`item` renamed to `value`"]),
    ('''class User:
    def __init__(self, name, email):
        self.name = name
        self.email = email

    def greet(self):
        return "Hello, " + self.name

    def contact(self):
        return self.name + " <" + self.email + ">"
''', ["`email` renamed to `address`", "`greet` renamed to `hello`", "`name` renamed to `username`",
      "`contact` renamed to `mailbox`"]),
    ('''class Rectangle:
    def __init__(self, width, height):
        self.width = width
        self.height = height

    def area(self):
        return self.width * self.height

    def perimeter(self):
        return 2 * (self.width + self.height)
''', ["`width` renamed to `w`", "`height` renamed to `h`", "`area` renamed to `surface`",
      "`perimeter` renamed to `border`"]),
    ('''class Timer:
    def __init__(self):
        self.start_time = None
        self.elapsed = 0.0

    def start(self):
        self.start_time = time.time()

    def stop(self):
        self.elapsed += time.time() - self.start_time
        self.start_time = None
''', ["`elapsed` renamed to `total_seconds`", "`start_time` renamed to `began`", "`stop` renamed to `halt`",
      "`start` renamed to `begin`"]),
    ('''class BankAccount:
    def __init__(self, owner, balance=0):
        self.owner = owner
        self.balance = balance

    def deposit(self, amount):
        self.balance += amount
        return self.balance

    def withdraw(self, amount):
        self.balance -= amount
        return self.balance
''', ["`balance` renamed to `funds`", "`owner` renamed to `holder`", "`deposit` renamed to `pay_in`",
      "`amount` renamed to `value`"]),
    ('''class Inventory:
    def __init__(self):
        self.stock = {}

    def add(self, name, quantity):
        self.stock[name] = self.stock.get(name, 0) + quantity

    def remove(self, name, quantity):
        self.stock[name] = self.stock.get(name, 0) - quantity

    def count(self, name):
        return self.stock.get(name, 0)
''', ["`stock` renamed to `items`", "`quantity` renamed to `qty`", "`remove` renamed to `take`",
      "`count` renamed to `level`"]),
    ('''class Point:
    def __init__(self, x, y):
        self.x = x
        self.y = y

    def move(self, dx, dy):
        self.x += dx
        self.y += dy

    def distance(self, other):
        return ((self.x - other.x) ** 2 + (self.y - other.y) ** 2) ** 0.5
''', ["`move` renamed to `shift`", "`other` renamed to `target`", "`distance` renamed to `dist`",
      "`dx` renamed to `delta_x`"]),
    ('''class Logger:
    def __init__(self, name):
        self.name = name
        self.lines = []

    def info(self, text):
        self.lines.append("INFO " + self.name + ": " + text)

    def error(self, text):
        self.lines.append("ERROR " + self.name + ": " + text)

    def dump(self):
        return "\\n".join(self.lines)
''', ["`lines` renamed to `records`", "`text` renamed to `message`", "`dump` renamed to `render`",
      "`info` renamed to `note`"]),
    ('''class Queue:
    def __init__(self):
        self.head = []
        self.tail = []

    def put(self, item):
        self.tail.append(item)

    def get(self):
        if not self.head:
            while self.tail:
                self.head.append(self.tail.pop())
        return self.head.pop()
''', ["`put` renamed to `enqueue`", "`get` renamed to `dequeue`", "`head` renamed to `front`",
      "`tail` renamed to `back`"]),
]


def code_conversations(n: int) -> list[Conversation]:
    out = []
    for i in range(n):
        code, edits = _SNIPPETS[i % len(_SNIPPETS)]
        j = i // len(_SNIPPETS)
        if j >= len(edits):
            raise ValueError(f"only {_capacity('code')} distinct code-edit requests; asked for {n}")
        out.append([{"role": "user", "content": f"```python\n{code}```\nCopy this code exactly, with {edits[j]}."}])
    return out


# --- prose ------------------------------------------------------------------------------------

_PROSE_TOPICS = [
    "a lighthouse keeper who finds a message in a bottle", "a fox who learns to fly",
    "a city where it never stops raining", "an old clockmaker and his last clock", "a robot that wants to paint",
    "two rival bakers in a small village", "a girl who can talk to trees", "the last train of the night",
    "a dragon afraid of the dark", "a sailor lost in the fog", "a library that opens only at midnight",
    "a boy and his grandfather's violin", "a cat who runs a hotel", "the first snow in a desert town",
    "a detective who solves crimes by smell", "a garden on the moon", "a musician who lost her voice",
    "a map that redraws itself", "a village under a glacier", "a chess match that lasted a century",
]
_PROSE_FORMS = ["Write a short story about {}.", "Describe, in a few paragraphs, {}."]


def prose_conversations(n: int) -> list[Conversation]:
    out = []
    for i in range(n):
        topic = _PROSE_TOPICS[i % len(_PROSE_TOPICS)]
        j = i // len(_PROSE_TOPICS)
        if j >= len(_PROSE_FORMS):
            raise ValueError(f"only {_capacity('prose')} distinct prose requests; asked for {n}")
        out.append([{"role": "user", "content": _PROSE_FORMS[j].format(topic)}])
    return out


# --- the kinds together -----------------------------------------------------------------------

_BUILDERS = {"tool": tool_conversations, "code": code_conversations, "prose": prose_conversations}


def _capacity(kind: str) -> int:
    if kind == "tool":
        return len(_TOOL_REQUESTS) * min(len(values) for _, values in _TOOL_REQUESTS)
    if kind == "code":
        return len(_SNIPPETS) * min(len(edits) for _, edits in _SNIPPETS)
    return len(_PROSE_TOPICS) * len(_PROSE_FORMS)


def capacity(kind: str) -> int:
    """How many distinct conversations `conversations(kind, n)` can make."""
    if kind not in _BUILDERS:
        raise ValueError(f"unknown output kind {kind!r}; choose from {', '.join(KINDS)}")
    return _capacity(kind)


def conversations(kind: str, n: int) -> list[Conversation]:
    """`n` distinct conversations whose answers are of `kind`; the same ones on every call,
    and the first `m` of `n` are those of `conversations(kind, m)`."""
    if kind not in _BUILDERS:
        raise ValueError(f"unknown output kind {kind!r}; choose from {', '.join(KINDS)}")
    return _BUILDERS[kind](n)


WARMUP_CONVERSATION: Conversation = [{"role": "user", "content": "Say hello in three languages."}]


def _prompt_code(conversation: Conversation) -> str:
    text = conversation[-1]["content"]
    start = text.find("```python\n")
    end = text.find("```", start + 10)
    return text[start + 10:end] if start >= 0 and end > start else ""


def looks_like(kind: str, conversation: Conversation, text: str) -> bool:
    """Whether an answer is of its kind: a JSON object naming a tool; a code block quoting
    at least two lines of the prompt's code; prose (no code block, no JSON object)."""
    stripped = text.strip()
    if kind == "tool":
        return stripped.startswith("{") and '"name"' in stripped[:40]
    if kind == "code":
        lines = [line.strip() for line in _prompt_code(conversation).splitlines() if len(line.strip()) >= 8]
        quoted = sum(1 for line in lines if line in text)
        return "```" in text and quoted >= 2
    if kind == "prose":
        return "```" not in text and not stripped.startswith("{") and len(stripped.split()) >= 10
    raise ValueError(f"unknown output kind {kind!r}")
