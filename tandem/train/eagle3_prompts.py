"""Built-in prompts for training an EAGLE-3 head on the target's own answers.

A head learns what the target tends to say next, so its training prompts should look like the
traffic it will serve: tandem serves agents, so tool-calling turns (JSON arguments, file paths,
shell commands), code tasks, and ordinary prose questions. The lists are crossed with a few
phrasings to get a few hundred varied conversations without shipping a data set; the order is
interleaved so that any prefix of the list (a time-limited run) covers every kind.
"""

from __future__ import annotations

import json
from itertools import zip_longest
from pathlib import Path
from typing import Any

Conversation = list[dict[str, str]]

_TOOLS = [
    {"name": "get_weather", "description": "Current weather and forecast for a city",
     "parameters": {"city": "string", "days": "integer"}},
    {"name": "search_web", "description": "Search the web", "parameters": {"query": "string", "max_results": "integer"}},
    {"name": "read_file", "description": "Read a text file", "parameters": {"path": "string"}},
    {"name": "write_file", "description": "Write a text file", "parameters": {"path": "string", "content": "string"}},
    {"name": "run_shell", "description": "Run a shell command and return its output", "parameters": {"command": "string"}},
    {"name": "send_email", "description": "Send an email", "parameters": {"to": "string", "subject": "string", "body": "string"}},
    {"name": "create_event", "description": "Add a calendar event",
     "parameters": {"title": "string", "start": "ISO 8601 datetime", "duration_minutes": "integer"}},
    {"name": "convert_currency", "description": "Convert an amount between currencies",
     "parameters": {"amount": "number", "from": "string", "to": "string"}},
    {"name": "sql_query", "description": "Run a read-only SQL query on the company database",
     "parameters": {"query": "string"}},
]

_AGENT_SYSTEM = (
    "You are an assistant that can call tools. Available tools (JSON):\n{tools}\n"
    "To call a tool, answer with a single JSON object {{\"name\": ..., \"arguments\": {{...}}}} and nothing "
    "else. If no tool is needed, answer normally."
)

_AGENT_REQUESTS = [
    "What's the weather going to be like in Paris for the next three days?",
    "Find recent news about the James Webb Space Telescope.",
    "Show me what's in config/settings.yaml.",
    "Create a file notes/todo.md with a checklist for moving house.",
    "How much disk space is left on this machine?",
    "List the Python files in the src directory.",
    "Email alice@example.com that the report will be late by one day.",
    "Put a 30 minute meeting called 'Design review' on my calendar tomorrow at 10am.",
    "Convert 250 US dollars to euros.",
    "How many orders did we get last month? The table is called orders with a created_at column.",
    "Run the unit tests in the tests folder and tell me if anything fails.",
    "Search for the best hiking trails near Denver.",
    "Read README.md and tell me how to install the project.",
    "Is it going to rain in Tokyo this weekend?",
    "Write a .gitignore for a Python project to the repository root.",
    "Which customers spent more than 1000 dollars this year?",
    "Check which git branch I'm on.",
    "Send Bob (bob@example.com) the agenda for Friday's meeting: budget, hiring, roadmap.",
    "Convert 10,000 Japanese yen into British pounds.",
    "Find the population of Canada in 2023.",
    "What does the function main in app/server.py do? Read it first.",
    "Schedule 'Dentist' next Monday at 3pm for one hour.",
    "Install the requests package with pip.",
    "Count the rows in the users table.",
    "What's the temperature in Berlin right now?",
    "Look up the current exchange rate between the Swiss franc and the euro and convert 80 francs.",
    "Open logs/error.log and tell me the most recent error.",
    "Save a short summary of today's meeting to notes/meeting.md: we agreed to ship on Friday.",
    "Which Python version is installed here?",
    "Find papers about speculative decoding for large language models.",
    "Email the team (team@example.com) that the office is closed on Monday.",
    "Book a 45 minute 'Sprint planning' for Thursday at 2pm.",
    "What were the top five products by revenue last quarter? Use the sales table.",
    "Delete the temporary files in /tmp/build using a shell command.",
    "Will I need an umbrella in London tomorrow?",
    "Read package.json and list the dependencies.",
    "Search for a vegetarian lasagna recipe.",
    "Create requirements.txt with numpy, pandas and requests.",
    "How many users signed up in the last seven days?",
    "Show the last five git commits.",
]

_CODE_TASKS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Implement binary search in Python and explain its complexity.",
    "Write a JavaScript function that debounces another function.",
    "Write a SQL query that finds the second highest salary in an employees table.",
    "Write a bash script that renames every .txt file in a folder to .md.",
    "Explain the difference between a list and a tuple in Python, with examples.",
    "Write a Python class for a stack with push, pop and peek.",
    "Fix this code: `def add(a, b): return a - b`.",
    "Write a function in Python that merges two sorted lists.",
    "Write a Python script that counts word frequencies in a text file.",
    "Explain what a race condition is and show an example in Python with threads.",
    "Write a Rust function that reverses a vector in place.",
    "Write a Go HTTP handler that returns JSON {\"status\": \"ok\"}.",
    "Write a Python decorator that measures how long a function takes.",
    "Convert this loop to a list comprehension: `out = []\nfor x in xs:\n    if x > 0:\n        out.append(x * 2)`.",
    "Write unit tests with pytest for a function `slugify(title)`.",
    "Write a regular expression that matches email addresses and explain it.",
    "Write a Python function that flattens a nested list.",
    "Explain recursion to a beginner with a Python example.",
    "Write a TypeScript interface for a user with id, name, email and optional age.",
    "Write a Python function that reads a CSV file and returns the average of a column.",
    "How do I reverse a string in C? Show the code.",
    "Write a Dockerfile for a small Flask application.",
    "Write a Python function that returns all prime numbers below n (sieve of Eratosthenes).",
    "Explain the difference between `==` and `is` in Python.",
    "Write a SQL query that counts orders per customer and sorts by the count.",
    "Write a Python generator that yields the lines of a file without the trailing newline.",
    "Implement quicksort in Python.",
    "What does `git rebase` do? Give an example.",
    "Write a JavaScript function that fetches JSON from a URL with async/await and handles errors.",
    "Write a Python dataclass for a 2D point with a method that computes the distance to another point.",
    "Explain big-O notation with three examples.",
    "Write a bash one-liner that counts the lines of all .py files in a directory tree.",
    "Write a Python function that validates an IPv4 address.",
    "Refactor this function to be more readable: `def f(l): return [x for x in l if x%2==0 and x>10]`.",
    "Write a C function that computes the length of a string without strlen.",
    "Explain what a REST API is and show an example request with curl.",
    "Write a Python context manager that changes the working directory temporarily.",
    "Write a Python function that converts a Roman numeral to an integer.",
]

_TOPICS = [
    "photosynthesis", "the French Revolution", "black holes", "inflation", "the immune system",
    "climate change", "the printing press", "neural networks", "volcanoes", "the Roman Empire",
    "compound interest", "sleep", "the water cycle", "electric cars", "the stock market",
    "vaccines", "the Internet", "plate tectonics", "coffee", "the Renaissance",
    "solar panels", "the human heart", "honey bees", "the Great Wall of China", "machine translation",
    "earthquakes", "the Olympic Games", "antibiotics", "the ocean tides", "cryptocurrencies",
    "the theory of evolution", "rainforests", "the printing of money", "nuclear energy", "jazz music",
    "the moon landing", "recycling", "the speed of light", "ancient Egypt", "electric guitars",
]

_PROSE_FORMS = [
    "Explain {topic} in simple terms.",
    "Write a short paragraph about {topic}.",
    "What are three interesting facts about {topic}?",
    "Give me a summary of {topic} for a high school student.",
    "What are the pros and cons of {topic}?",
]

_WRITING = [
    "Write a short story about a robot who learns to paint.",
    "Write a polite email asking my manager for a day off next Friday.",
    "Give me five tips for staying productive when working from home.",
    "Write a haiku about autumn.",
    "Plan a three-day trip to Rome.",
    "What should I cook for dinner with rice, eggs and spinach?",
    "Describe the rules of chess briefly.",
    "How do I prepare for a job interview?",
    "Write a product description for a reusable water bottle.",
    "Summarize the plot of Romeo and Juliet.",
    "Write a limerick about a cat who loves coffee.",
    "Give me a weekly workout plan for a beginner.",
    "Write a thank-you note to a colleague who helped me with a project.",
    "How can I improve my sleep?",
    "Write a short motivational speech for a team before a deadline.",
    "What are good questions to ask at the end of a job interview?",
    "Write a two-paragraph review of an imaginary restaurant.",
    "Explain how to make a cup of tea, step by step.",
    "Suggest five names for a bakery and explain each.",
    "Write a short dialogue between a customer and a shop assistant.",
]


def builtin_conversations() -> list[Conversation]:
    """Agent tool calls, code tasks and prose, interleaved (see the module docstring)."""
    tools = json.dumps(_TOOLS)
    agent = [[{"role": "system", "content": _AGENT_SYSTEM.format(tools=tools)}, {"role": "user", "content": r}]
             for r in _AGENT_REQUESTS]
    code = [[{"role": "user", "content": task}] for task in _CODE_TASKS]
    prose = [[{"role": "user", "content": form.format(topic=topic)}]
             for i, topic in enumerate(_TOPICS) for form in _PROSE_FORMS[i % 2 :: 2]]
    writing = [[{"role": "user", "content": text}] for text in _WRITING]
    mixed = zip_longest(agent, code, prose[: len(prose) // 2], writing, prose[len(prose) // 2 :])
    return [conversation for group in mixed for conversation in group if conversation is not None]


def read_prompt_file(path: Path) -> list[Conversation]:
    """A JSONL file, one conversation per line: {"messages": [...]}, {"prompt": "text"}, or a
    JSON string."""
    conversations = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item: Any = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not JSON ({exc.msg})") from None
        if isinstance(item, str):
            conversations.append([{"role": "user", "content": item}])
        elif isinstance(item, dict) and isinstance(item.get("messages"), list) and item["messages"]:
            conversations.append(item["messages"])
        elif isinstance(item, dict) and isinstance(item.get("prompt"), str):
            conversations.append([{"role": "user", "content": item["prompt"]}])
        else:
            raise ValueError(f'{path}:{number}: expected {{"messages": [...]}}, {{"prompt": "..."}} or a string')
    return conversations
