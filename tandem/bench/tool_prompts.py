"""The held-out tool-calling prompts of `tandem bench tools`, generated from hand-written parts.

A case is what one request of the validity bench sends and what it should get back: a list of
2-6 OpenAI function tools (the expected ones among distractors, shuffled), the messages, and
the names of the calls a correct answer makes (one, or two for a parallel case). Nothing here
was tuned on a model's answers: the tools, the phrasings and the slot values were written for
this bench, so a rate measured on them is a held-out figure.

Why generated and not a file: the set is the product of ~34 tools with nested objects, arrays,
enums, integers with ranges and required/optional fields, ~60 request templates and pools of
slot values, combined under seeded generators; the code is shorter than the 220 cases it
makes, and every case is reproducible from (seed, index). `build_cases` interleaves the four
kinds (single call, enum argument, nested arguments, two calls in one answer), so the first N
cases of `--num-cases N` hold every kind.

Every object schema says `additionalProperties: false`: an argument the model invents is a
malformed call (as BFCL counts it), and the schemas are what OpenAI's strict mode accepts.
"""

from __future__ import annotations

import random
import re
import string
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

KINDS = ("single", "enum", "nested", "parallel")
DEFAULT_CASES = {"single": 56, "enum": 56, "nested": 52, "parallel": 60}  # 224 in all
MIN_TOOLS, MAX_TOOLS = 2, 6


# --- schema building blocks ----------------------------------------------------------------


def _str(description: str, **extra: Any) -> dict[str, Any]:
    return {"type": "string", "description": description, **extra}


def _int(description: str, low: int, high: int) -> dict[str, Any]:
    return {"type": "integer", "description": description, "minimum": low, "maximum": high}


def _num(description: str, **extra: Any) -> dict[str, Any]:
    return {"type": "number", "description": description, **extra}


def _bool(description: str) -> dict[str, Any]:
    return {"type": "boolean", "description": description}


def _enum(description: str, values: Sequence[str]) -> dict[str, Any]:
    return {"type": "string", "description": description, "enum": list(values)}


def _array(description: str, items: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"type": "array", "description": description, "items": items, **extra}


def _object(properties: dict[str, Any], required: Sequence[str] = (), description: str | None = None,
            additional: bool | dict[str, Any] = False) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object"}
    if description:
        schema["description"] = description
    schema["properties"] = properties
    if required:
        schema["required"] = list(required)
    schema["additionalProperties"] = additional
    return schema


@dataclass(frozen=True)
class ToolSpec:
    """One function a case may offer: its name, what it does, its parameters' JSON schema."""

    name: str
    description: str
    parameters: dict[str, Any]

    def openai(self, strict: bool = False) -> dict[str, Any]:
        """The OpenAI `tools` entry; `strict` marks it for schema-constrained arguments."""
        function: dict[str, Any] = {"name": self.name, "description": self.description,
                                    "parameters": self.parameters}
        if strict:
            function["strict"] = True
        return {"type": "function", "function": function}


_DATABASES = ("analytics", "billing", "inventory", "users")
_UNITS = ("meters", "kilometers", "miles", "feet", "inches", "centimeters", "kilograms", "pounds",
          "ounces", "grams", "celsius", "fahrenheit", "liters", "gallons")
_CURRENCIES = ("USD", "EUR", "GBP", "JPY", "CHF", "CAD", "AUD", "INR")
_LANGUAGES = ("english", "french", "german", "spanish", "italian", "japanese", "portuguese", "dutch")
_AIRPORT = r"^[A-Z]{3}$"
_DATE = r"^\d{4}-\d{2}-\d{2}$"

TOOLS: tuple[ToolSpec, ...] = (
    ToolSpec("get_current_weather", "Get the current weather at a location.", _object({
        "location": _str("City name, optionally with the country, e.g. 'Lyon, France'"),
        "unit": _enum("Temperature unit", ("celsius", "fahrenheit")),
    }, ["location"])),
    ToolSpec("get_weather_forecast", "Get a daily weather forecast for the next days.", _object({
        "location": _str("City name"),
        "days": _int("Number of days to forecast", 1, 14),
        "include": _array("Extra fields to include in each day's forecast",
                          _enum("Field", ("precipitation", "wind", "humidity", "uv_index")), uniqueItems=True),
    }, ["location", "days"])),
    ToolSpec("create_calendar_event", "Create an event in the user's calendar and invite attendees.", _object({
        "title": _str("Event title"),
        "start": _str("Start as an ISO 8601 local date-time, e.g. 2025-03-14T09:30"),
        "duration_minutes": _int("Length of the event in minutes", 5, 480),
        "attendees": _array("People to invite", _object({
            "email": _str("Attendee email address"),
            "optional": _bool("Whether attendance is optional"),
        }, ["email"])),
        "location": _object({
            "name": _str("Room or venue name"),
            "address": _str("Street address"),
        }, ["name"], description="Where the event takes place"),
        "reminder_minutes": _int("Minutes before the start to send a reminder", 0, 1440),
    }, ["title", "start"])),
    ToolSpec("list_calendar_events", "List the events of one day in a calendar.", _object({
        "date": _str("Day to list, YYYY-MM-DD", pattern=_DATE),
        "calendar": _enum("Which calendar", ("work", "personal", "family", "shared")),
        "max_results": _int("Most events to return", 1, 50),
    }, ["date"])),
    ToolSpec("read_file", "Read a text file from the workspace.", _object({
        "path": _str("Path of the file, relative to the workspace root"),
        "encoding": _enum("Text encoding", ("utf-8", "latin-1", "ascii")),
        "max_bytes": _int("Stop after this many bytes", 1, 10_485_760),
    }, ["path"])),
    ToolSpec("write_file", "Write text to a file in the workspace.", _object({
        "path": _str("Path of the file"),
        "content": _str("Text to write"),
        "mode": _enum("overwrite replaces the file, append adds to its end, create_only fails if it exists",
                      ("overwrite", "append", "create_only")),
    }, ["path", "content"])),
    ToolSpec("delete_path", "Delete a file or a directory.", _object({
        "path": _str("Path to delete"),
        "recursive": _bool("Delete a directory with everything in it"),
    }, ["path"])),
    ToolSpec("search_files", "Search file contents under a directory for a text pattern.", _object({
        "directory": _str("Directory to search"),
        "pattern": _str("Text or regular expression to look for"),
        "extensions": _array("Only files with these extensions, e.g. '.py'", _str("Extension")),
        "max_results": _int("Most matches to return", 1, 500),
    }, ["directory", "pattern"])),
    ToolSpec("git_commit", "Record staged changes of the given files in a new git commit.", _object({
        "message": _str("Commit message"),
        "files": _array("Files to include", _str("File path"), minItems=1),
        "amend": _bool("Amend the previous commit instead of creating a new one"),
    }, ["message", "files"])),
    ToolSpec("git_create_branch", "Create a git branch.", _object({
        "name": _str("Branch name", pattern=r"^[a-z0-9][a-z0-9._/-]*$"),
        "base": _str("Commit or branch to start from (default: the current HEAD)"),
    }, ["name"])),
    ToolSpec("git_log", "Show recent git commits.", _object({
        "max_count": _int("Number of commits", 1, 100),
        "author": _str("Only commits by this author"),
        "path": _str("Only commits touching this path"),
    })),
    ToolSpec("run_sql_query", "Run a read-only SQL query on one of the company databases.", _object({
        "database": _enum("Database to query", _DATABASES),
        "query": _str("The SQL statement"),
        "timeout_seconds": _int("Cancel the query after this long", 1, 300),
    }, ["database", "query"])),
    ToolSpec("describe_table", "Show the columns and types of a database table.", _object({
        "database": _enum("Database holding the table", _DATABASES),
        "table": _str("Table name"),
    }, ["database", "table"])),
    ToolSpec("convert_units", "Convert a quantity from one unit to another.", _object({
        "value": _num("Quantity to convert"),
        "from_unit": _enum("Unit of the value", _UNITS),
        "to_unit": _enum("Unit to convert to", _UNITS),
    }, ["value", "from_unit", "to_unit"])),
    ToolSpec("convert_currency", "Convert an amount of money at today's exchange rate.", _object({
        "amount": _num("Amount to convert", minimum=0),
        "from_currency": _enum("ISO code of the amount's currency", _CURRENCIES),
        "to_currency": _enum("ISO code of the target currency", _CURRENCIES),
    }, ["amount", "from_currency", "to_currency"])),
    ToolSpec("add_to_cart", "Add a product to the shopping cart.", _object({
        "product_id": _str("Product identifier, e.g. SKU-1042"),
        "quantity": _int("How many", 1, 99),
        "options": _object({
            "size": _enum("Clothing size", ("XS", "S", "M", "L", "XL")),
            "color": _str("Color name"),
            "gift_wrap": _bool("Wrap as a gift"),
        }, description="Product options"),
    }, ["product_id", "quantity"])),
    ToolSpec("remove_from_cart", "Remove a product from the shopping cart.", _object({
        "product_id": _str("Product identifier"),
        "quantity": _int("How many to remove (default: all)", 1, 99),
    }, ["product_id"])),
    ToolSpec("checkout", "Pay for the cart and ship it.", _object({
        "payment_method": _enum("How to pay", ("card", "paypal", "gift_card", "bank_transfer")),
        "shipping_address": _object({
            "street": _str("Street and number"),
            "city": _str("City"),
            "postal_code": _str("Postal code"),
            "country": _str("Two-letter country code, e.g. DE", pattern=r"^[A-Z]{2}$"),
        }, ["street", "city", "postal_code", "country"], description="Where to ship"),
        "express_shipping": _bool("Ship express"),
        "coupon_code": _str("Discount code"),
    }, ["payment_method", "shipping_address"])),
    ToolSpec("search_flights", "Search for flights between two airports.", _object({
        "origin": _str("IATA code of the departure airport", pattern=_AIRPORT),
        "destination": _str("IATA code of the arrival airport", pattern=_AIRPORT),
        "departure_date": _str("YYYY-MM-DD", pattern=_DATE),
        "return_date": _str("YYYY-MM-DD for a round trip", pattern=_DATE),
        "passengers": _object({
            "adults": _int("Adults", 1, 9),
            "children": _int("Children aged 2-11", 0, 8),
            "infants": _int("Infants under 2", 0, 4),
        }, ["adults"], description="Who travels"),
        "cabin_class": _enum("Cabin", ("economy", "premium_economy", "business", "first")),
        "max_stops": _int("Most stops", 0, 3),
    }, ["origin", "destination", "departure_date"])),
    ToolSpec("book_hotel", "Book a hotel room.", _object({
        "city": _str("City"),
        "check_in": _str("YYYY-MM-DD", pattern=_DATE),
        "check_out": _str("YYYY-MM-DD", pattern=_DATE),
        "guests": _int("Number of guests", 1, 10),
        "room_type": _enum("Room type", ("single", "double", "twin", "suite")),
        "amenities": _array("Required amenities",
                            _enum("Amenity", ("wifi", "breakfast", "parking", "pool", "gym")), uniqueItems=True),
    }, ["city", "check_in", "check_out"])),
    ToolSpec("send_email", "Send an email.", _object({
        "to": _array("Recipient addresses", _str("Email address"), minItems=1),
        "subject": _str("Subject line"),
        "body": _str("Message text"),
        "cc": _array("Addresses to copy", _str("Email address")),
        "priority": _enum("Priority flag", ("low", "normal", "high")),
    }, ["to", "subject", "body"])),
    ToolSpec("post_chat_message", "Post a message to a team chat channel.", _object({
        "channel": _str("Channel name starting with #", pattern=r"^#[a-z0-9-]+$"),
        "text": _str("Message text"),
        "notify": _enum("none, here (members online) or channel (every member)", ("none", "here", "channel")),
    }, ["channel", "text"])),
    ToolSpec("create_ticket", "File an issue in the bug tracker.", _object({
        "title": _str("Short summary"),
        "description": _str("Details"),
        "priority": _enum("P0 is the most urgent", ("P0", "P1", "P2", "P3")),
        "labels": _array("Labels", _str("Label")),
        "assignee": _str("Username of the assignee"),
    }, ["title", "priority"])),
    ToolSpec("translate_text", "Translate text into another language.", _object({
        "text": _str("Text to translate"),
        "target_language": _enum("Language to translate into", _LANGUAGES),
        "formality": _enum("Register of the translation", ("formal", "informal", "default")),
    }, ["text", "target_language"])),
    ToolSpec("calculate", "Evaluate an arithmetic expression.", _object({
        "expression": _str("Expression with + - * / ^ and parentheses"),
        "precision": _int("Decimal places of the result", 0, 15),
    }, ["expression"])),
    ToolSpec("set_reminder", "Set a reminder at a time of day.", _object({
        "text": _str("What to be reminded of"),
        "time": _str("24-hour time HH:MM", pattern=r"^([01]\d|2[0-3]):[0-5]\d$"),
        "repeat": _enum("How often", ("none", "daily", "weekdays", "weekly", "monthly")),
    }, ["text", "time"])),
    ToolSpec("get_stock_quote", "Get the latest price of a stock.", _object({
        "symbol": _str("Ticker symbol, e.g. AAPL", pattern=r"^[A-Z]{1,5}$"),
        "exchange": _enum("Stock exchange", ("NYSE", "NASDAQ", "LSE", "TSE")),
        "include_history": _bool("Include the last 30 days of closing prices"),
    }, ["symbol"])),
    ToolSpec("play_music", "Play music or a podcast on the user's speakers.", _object({
        "query": _str("Song, artist, genre, station or show"),
        "source": _enum("Where to play from", ("library", "radio", "podcast")),
        "shuffle": _bool("Shuffle the results"),
        "volume": _int("Volume in percent", 0, 100),
    }, ["query"])),
    ToolSpec("set_light", "Control the smart lights of a room.", _object({
        "room": _str("Room name"),
        "power": _enum("Switch the lights on or off", ("on", "off")),
        "brightness": _int("Brightness in percent", 0, 100),
        "color": _object({
            "r": _int("Red", 0, 255),
            "g": _int("Green", 0, 255),
            "b": _int("Blue", 0, 255),
        }, ["r", "g", "b"], description="RGB color"),
    }, ["room", "power"])),
    ToolSpec("deploy_service", "Deploy a version of a service to an environment.", _object({
        "service": _str("Service name"),
        "environment": _enum("Target environment", ("dev", "staging", "production")),
        "version": _str("Version tag, e.g. v1.4.2"),
        "replicas": _int("Number of replicas", 1, 50),
        "env_vars": _object({}, description="Environment variables to set, name to value",
                            additional={"type": "string"}),
    }, ["service", "environment", "version"])),
    ToolSpec("get_directions", "Get directions between two places.", _object({
        "origin": _str("Start address or place"),
        "destination": _str("End address or place"),
        "mode": _enum("How to travel", ("driving", "walking", "bicycling", "transit")),
        "avoid": _array("Features to avoid", _enum("Feature", ("tolls", "highways", "ferries")), uniqueItems=True),
    }, ["origin", "destination"])),
    ToolSpec("resize_image", "Resize an image file.", _object({
        "path": _str("Image path"),
        "width": _int("Width in pixels", 1, 8192),
        "height": _int("Height in pixels", 1, 8192),
        "format": _enum("Output format", ("png", "jpeg", "webp")),
        "keep_aspect_ratio": _bool("Fit inside width x height instead of stretching"),
    }, ["path", "width", "height"])),
    ToolSpec("lookup_order", "Look up the status of a customer order.", _object({
        "order_id": _str("Order number, e.g. ORD-204817", pattern=r"^ORD-\d{6}$"),
        "include_items": _bool("List the items of the order"),
    }, ["order_id"])),
    ToolSpec("create_user", "Create an account in the admin console.", _object({
        "username": _str("Lowercase login name", pattern=r"^[a-z][a-z0-9_]{2,15}$"),
        "email": _str("Email address"),
        "role": _enum("Permissions", ("viewer", "editor", "admin")),
        "profile": _object({
            "full_name": _str("Full name"),
            "age": _int("Age in years", 13, 120),
            "interests": _array("Interests", _str("Interest")),
        }, description="Optional profile"),
    }, ["username", "email", "role"])),
)
TOOLS_BY_NAME = {tool.name: tool for tool in TOOLS}


# --- what users ask --------------------------------------------------------------------------

SLOTS: dict[str, tuple[Any, ...]] = {
    "city": ("Lisbon", "Osaka", "Toronto", "Nairobi", "Reykjavik", "Buenos Aires", "Hanoi", "Denver",
             "Krakow", "Melbourne", "Marseille", "Seattle"),
    "date": ("2025-03-14", "2025-04-02", "2025-05-19", "2025-06-30", "2025-07-08", "2025-09-11",
             "2025-10-27", "2025-12-01"),
    "time": ("07:45", "09:30", "12:15", "14:00", "16:40", "18:05", "21:30"),
    "path": ("src/app/main.py", "README.md", "docs/setup.md", "config/settings.yaml", "notes/todo.txt",
             "scripts/build.sh", "data/report.csv", "tests/test_parser.py"),
    "dir": ("src", "lib/utils", "services/api", "docs", "tests", "frontend/components"),
    "word": ("TODO", "deprecated", "retry_count", "parse_header", "FIXME", "api_key"),
    "branch": ("feature/login-form", "fix/null-pointer", "release/2.3", "docs/typos", "perf/cache-keys"),
    "n_small": (3, 5, 10, 15, 20),
    "expr": ("(17 + 25) * 3", "2^10 - 24", "144 / 12 + 7", "3.5 * (8 - 2.25)", "1000 / 7"),
    "product": ("SKU-1042", "SKU-2210", "SKU-3318", "SKU-0457", "SKU-7781", "SKU-5063"),
    "order_id": ("ORD-204817", "ORD-553190", "ORD-100274", "ORD-874401", "ORD-312968"),
    "ticker": ("AAPL", "MSFT", "NVDA", "TSLA", "KO", "IBM", "SAP"),
    "genre": ("jazz", "lo-fi beats", "classical piano", "80s rock", "bossa nova"),
    "place": ("the central station", "the airport", "the city museum", "Harbor Park", "the university campus",
              "Oak Street 12"),
    "image": ("photos/beach.jpg", "assets/logo.png", "uploads/avatar.png", "img/banner.jpeg"),
    "w": (320, 640, 800, 1024, 1920),
    "h": (240, 480, 600, 768, 1080),
    "email": ("ana@example.com", "li.wei@example.org", "sam.k@example.net", "priya@example.com",
              "jonas@example.org", "fatima@example.net"),
    "subject": ("Quarterly numbers", "Lunch on Friday", "Server maintenance", "Draft for review"),
    "body": ("The report is attached, please have a look.", "Can we move it to 1 pm?",
             "We will be offline between 2 and 3 am.", "Let me know what you think."),
    "commit_msg": ("Fix off-by-one in pagination", "Add retry to the HTTP client", "Update install docs",
                   "Remove unused imports"),
    "file": ("src/pager.py", "src/http.py", "docs/install.md", "src/utils.py", "tests/test_pager.py"),
    "value": (3, 12.5, 42, 100, 7.25, 250),
    "unit_pair": (("miles", "kilometers"), ("pounds", "kilograms"), ("fahrenheit", "celsius"),
                  ("inches", "centimeters"), ("gallons", "liters"), ("feet", "meters"), ("ounces", "grams")),
    "amount": (20, 75.5, 150, 1200, 49.99),
    "currency": _CURRENCIES,
    "db": _DATABASES,
    "sql": ("SELECT COUNT(*) FROM orders WHERE status = 'open'", "SELECT name, email FROM customers LIMIT 10",
            "SELECT sku, stock FROM products WHERE stock < 5", "SELECT AVG(amount) FROM invoices"),
    "table": ("orders", "customers", "invoices", "products", "sessions"),
    "phrase": ("Where is the nearest train station?", "Thank you for your help.",
               "The meeting is postponed until next week.", "Could you send me the invoice?"),
    "language": tuple(x.capitalize() for x in _LANGUAGES if x != "english"),
    "task": ("water the plants", "take my medication", "call the bank", "stretch", "submit the timesheet"),
    "repeat": (("every day", "daily"), ("on weekdays", "weekdays"), ("every week", "weekly"),
               ("every month", "monthly")),
    "priority": ("P0", "P1", "P2", "P3"),
    "issue": ("Login button does nothing on Safari", "Export to CSV drops the last row",
              "Dark mode colors are unreadable", "Search is slow for long queries"),
    "channel": ("general", "deploys", "team-backend", "random", "incidents"),
    "announcement": ("The build is green again", "Standup moves to 10:30 today", "v2.4 is released",
                     "Please review the on-call schedule"),
    "service": ("checkout-api", "search-indexer", "auth-service", "billing-worker"),
    "version": ("v1.4.2", "v2.0.0", "v3.1.7", "v0.9.12"),
    "env": ("dev", "staging", "production"),
    "room": ("kitchen", "living room", "bedroom", "office", "hallway"),
    "room_type": ("single", "double", "twin", "suite"),
    "cabin": (("economy", "economy"), ("premium economy", "premium_economy"), ("business class", "business"),
              ("first class", "first")),
    "airport": ("LIS", "JFK", "NRT", "CDG", "SYD", "GRU", "YYZ", "FRA"),
    "podcast": ("The Daily Build", "History Hour", "Science Weekly", "Startup Stories"),
    "role": ("viewer", "editor", "admin"),
    "username": ("mlopez", "tchen", "akumar", "jsmith", "nrossi"),
    "mode": (("walking", "walking"), ("cycling", "bicycling"), ("driving", "driving"),
             ("public transit", "transit")),
    "calendar": ("work", "personal", "family", "shared"),
    "exchange": ("NYSE", "NASDAQ", "LSE", "TSE"),
    "line": ("Remember to rotate the keys.", "Build passed on 2025-03-14.", "TODO: update the changelog."),
    "meeting": ("Design review", "Sprint planning", "1:1 with Dana", "Budget sync"),
    "minutes": (15, 30, 45, 60, 90),
    "room_name": ("Room Atlas", "Room Borealis", "the 3rd floor lounge"),
    "address": ("10 Market Street", "221 King Road", "5 Rue de la Paix"),
    "payment": (("my card", "card"), ("PayPal", "paypal"), ("a gift card", "gift_card"),
                ("bank transfer", "bank_transfer")),
    "street": ("Hauptstrasse 5", "742 Evergreen Terrace", "Calle Mayor 18", "12 Baker Street"),
    "postal": ("10115", "97403", "28013", "NW1 6XE"),
    "country": (("Germany", "DE"), ("the United States", "US"), ("Spain", "ES"), ("the UK", "GB")),
    "adults": (1, 2, 3, 4),
    "children": (1, 2, 3),
    "qty": (1, 2, 3, 5),
    "size": ("XS", "S", "M", "L", "XL"),
    "color": ("navy", "red", "forest green", "black", "white"),
    "rgb": ((255, 120, 0), (0, 128, 255), (200, 30, 90), (255, 255, 255), (80, 200, 120)),
    "pct": (20, 40, 60, 75, 100),
    "loglevel": ("debug", "info", "warn"),
    "region": ("eu-west-1", "us-east-2", "ap-south-1"),
    "full_name": ("Maria Lopez", "Tom Chen", "Anil Kumar", "Jane Smith", "Nina Rossi"),
    "age": (19, 27, 34, 45, 61),
    "interest": ("hiking", "chess", "photography", "cooking", "cycling", "astronomy"),
    "days": (3, 5, 7, 10),
    "guests": (1, 2, 3, 4),
}


@dataclass(frozen=True)
class Ask:
    """A request template for one tool: `{slot}` placeholders draw from SLOTS (a trailing digit,
    `{city2}`, draws another value of the same pool); `{slot.0}` / `{slot.1}` index a pair, so
    a phrase and the enum value it means are drawn together."""

    tool: str
    kind: str  # single | enum | nested
    template: str


ASKS: tuple[Ask, ...] = (
    # single: one call, flat arguments
    Ask("get_current_weather", "single", "What's the weather like in {city} right now?"),
    Ask("get_current_weather", "single", "Is it raining in {city} at the moment?"),
    Ask("list_calendar_events", "single", "What do I have scheduled on {date}?"),
    Ask("read_file", "single", "Show me what's in {path}."),
    Ask("delete_path", "single", "Please delete {path}, I don't need it anymore."),
    Ask("search_files", "single", "Find every occurrence of {word} in the {dir} directory."),
    Ask("git_create_branch", "single", "Create a new branch named {branch}."),
    Ask("git_log", "single", "Show me the last {n_small} commits."),
    Ask("calculate", "single", "Compute {expr} for me."),
    Ask("remove_from_cart", "single", "Take {product} out of my cart."),
    Ask("lookup_order", "single", "Where is my order {order_id}?"),
    Ask("get_stock_quote", "single", "What's the current price of {ticker}?"),
    Ask("play_music", "single", "Put on some {genre}."),
    Ask("get_directions", "single", "How do I get from {place} to {place2}?"),
    Ask("resize_image", "single", "Resize {image} to {w}x{h} pixels."),
    Ask("write_file", "single", "Save the text '{line}' into {path}."),
    Ask("git_commit", "single", "Commit {file} with the message '{commit_msg}'."),
    Ask("send_email", "single", "Email {email} with the subject '{subject}' and the text '{body}'."),
    Ask("add_to_cart", "single", "Add {qty} of {product} to my cart."),
    Ask("get_weather_forecast", "single", "What will the weather be in {city} over the next {days} days?"),
    # enum: the prompt names a value of an enum argument
    Ask("get_current_weather", "enum", "What's the temperature in {city}? Give it to me in fahrenheit."),
    Ask("convert_units", "enum", "Convert {value} {unit_pair.0} to {unit_pair.1}."),
    Ask("convert_currency", "enum", "How much is {amount} {currency} in {currency2}?"),
    Ask("run_sql_query", "enum", "On the {db} database, run this query: {sql}"),
    Ask("describe_table", "enum", "What columns does the {table} table in the {db} database have?"),
    Ask("translate_text", "enum", "Translate '{phrase}' into {language}, in a formal register."),
    Ask("set_reminder", "enum", "Remind me to {task} {repeat.0} at {time}."),
    Ask("create_ticket", "enum", "File a {priority} ticket: '{issue}'."),
    Ask("post_chat_message", "enum", "Post '{announcement}' in #{channel} and notify everyone who is online."),
    Ask("deploy_service", "enum", "Deploy {service} {version} to {env}."),
    Ask("book_hotel", "enum", "Book a {room_type} room in {city} from {date} to {date2}."),
    Ask("search_flights", "enum", "Find {cabin.0} flights from {airport} to {airport2} on {date}."),
    Ask("set_light", "enum", "Turn off the lights in the {room}."),
    Ask("play_music", "enum", "Play the podcast '{podcast}'."),
    Ask("read_file", "enum", "Read {path} with latin-1 encoding."),
    Ask("write_file", "enum", "Append the line '{line}' to {path}."),
    Ask("list_calendar_events", "enum", "What's on my {calendar} calendar on {date}?"),
    Ask("get_stock_quote", "enum", "Get me the quote for {ticker} on the {exchange}."),
    Ask("create_user", "enum", "Create an account for {username} ({email}) with the {role} role."),
    Ask("get_directions", "enum", "Give me {mode.0} directions from {place} to {place2}."),
    Ask("resize_image", "enum", "Convert {image} to webp at {w}x{h}."),
    # nested: objects inside objects, arrays of objects or of enums
    Ask("create_calendar_event", "nested",
        "Schedule '{meeting}' on {date} at {time} for {minutes} minutes with {email} and {email2}, "
        "in {room_name} at {address}."),
    Ask("create_calendar_event", "nested",
        "Put '{meeting}' in my calendar for {date} at {time}; invite {email} (optional) and remind me "
        "{minutes} minutes before."),
    Ask("checkout", "nested",
        "Check out and pay with {payment.0}. Ship to {street}, {postal} {city}, {country.0}."),
    Ask("search_flights", "nested",
        "Find flights from {airport} to {airport2} on {date} for {adults} adults and {children} children."),
    Ask("add_to_cart", "nested", "Add {qty} of {product} in size {size} and color {color}, gift wrapped."),
    Ask("set_light", "nested", "Set the {room} lights to the RGB color {rgb} at {pct}% brightness."),
    Ask("deploy_service", "nested",
        "Deploy {service} {version} to staging with LOG_LEVEL={loglevel} and REGION={region}."),
    Ask("create_user", "nested",
        "Create the viewer account {username} ({email}) with the profile: full name {full_name}, "
        "age {age}, interests {interest} and {interest2}."),
    Ask("get_weather_forecast", "nested",
        "Give me the {days}-day forecast for {city}, including wind and humidity."),
    Ask("book_hotel", "nested",
        "Book a double room in {city} from {date} to {date2} for {guests} guests; we need breakfast and parking."),
    Ask("get_directions", "nested", "Driving directions from {place} to {place2}, avoiding tolls and highways."),
    Ask("send_email", "nested",
        "Send a high-priority email to {email}, cc {email2}, subject '{subject}', saying '{body}'."),
    Ask("git_commit", "nested", "Commit {file} and {file2} together with the message '{commit_msg}'."),
    Ask("search_files", "nested",
        "Search {dir} for '{word}' in .py and .md files only, at most {n_small} results."),
)

# Two calls of one tool in one answer (the parallel kind also pairs asks of two tools).
TWIN_ASKS: tuple[Ask, ...] = (
    Ask("get_current_weather", "parallel", "What's the weather in {city} and in {city2}?"),
    Ask("get_stock_quote", "parallel", "Get me the prices of {ticker} and {ticker2}."),
    Ask("lookup_order", "parallel", "Check the status of orders {order_id} and {order_id2}."),
    Ask("read_file", "parallel", "Open {path} and {path2} so I can compare them."),
    Ask("convert_currency", "parallel", "Convert {amount} {currency} to {currency2}, and also to {currency3}."),
    Ask("remove_from_cart", "parallel", "Remove {product} and {product2} from my cart."),
)
_PAIRINGS = (
    "Two things, please. First: {a} Second: {b}",
    "{a} Also, separately: {b}",
    "Please do both of these: (1) {a} (2) {b}",
    "{a} And one more thing: {b}",
)
_SYSTEM_PROMPTS = (
    None,
    "You are a helpful assistant.",
    "You are an assistant with access to functions. Call them when they help answer the user.",
    "You help users get things done by calling the provided tools. Be concise.",
)
_PRIOR_TURNS = (
    ("Hi there!", "Hello! How can I help you today?"),
    ("I have a few errands for you.", "Sure, tell me what you need."),
    ("Are you able to use tools?", "Yes, I can call the tools I have been given."),
)
_PLACEHOLDER = re.compile(r"\{([a-z_]+?)(\d?)(?:\.(\d))?\}")


@dataclass(frozen=True)
class ToolCase:
    """One request of the validity bench and the names of the calls a right answer makes."""

    case_id: str
    kind: str
    tools: tuple[ToolSpec, ...]
    messages: tuple[dict[str, str], ...]
    expected: tuple[str, ...]

    def openai_tools(self, strict: bool = False) -> list[dict[str, Any]]:
        return [tool.openai(strict) for tool in self.tools]

    def schemas(self) -> dict[str, dict[str, Any]]:
        """Declared function name -> its parameters schema (what scoring validates against)."""
        return {tool.name: tool.parameters for tool in self.tools}

    def summary(self) -> dict[str, Any]:
        return {"id": self.case_id, "kind": self.kind, "tools": [t.name for t in self.tools],
                "expected": list(self.expected), "user": self.messages[-1]["content"]}


def render(template: str, rng: random.Random) -> str:
    """Fill a template's placeholders; the same placeholder twice gets the same value, and
    numbered ones of a pool get values different from each other."""
    drawn: dict[tuple[str, str], Any] = {}
    used: dict[str, list[Any]] = {}

    def fill(match: re.Match[str]) -> str:
        pool, number, index = match.group(1), match.group(2), match.group(3)
        key = (pool, number)
        if key not in drawn:
            choices = [v for v in SLOTS[pool] if v not in used.get(pool, [])]
            drawn[key] = rng.choice(choices)
            used.setdefault(pool, []).append(drawn[key])
        value = drawn[key]
        return str(value[int(index)] if index is not None else value)

    return _PLACEHOLDER.sub(fill, template)


def _tool_set(expected: Sequence[str], rng: random.Random) -> tuple[ToolSpec, ...]:
    wanted = list(dict.fromkeys(expected))
    total = rng.randint(max(MIN_TOOLS, len(wanted) + 1), MAX_TOOLS)  # at least one distractor
    others = [t.name for t in TOOLS if t.name not in wanted]
    names = wanted + rng.sample(others, total - len(wanted))
    rng.shuffle(names)
    return tuple(TOOLS_BY_NAME[n] for n in names)


def _messages(user: str, rng: random.Random) -> tuple[dict[str, str], ...]:
    messages: list[dict[str, str]] = []
    system = rng.choice(_SYSTEM_PROMPTS)
    if system is not None:
        messages.append({"role": "system", "content": system})
    if rng.random() < 0.25:
        said, answered = rng.choice(_PRIOR_TURNS)
        messages += [{"role": "user", "content": said}, {"role": "assistant", "content": answered}]
    messages.append({"role": "user", "content": user})
    return tuple(messages)


def _case(kind: str, index: int, seed: int) -> ToolCase:
    rng = random.Random(f"tandem-bench-tools:{seed}:{kind}:{index}")
    if kind != "parallel":
        asks = [a for a in ASKS if a.kind == kind]
        ask = asks[index % len(asks)]
        user, expected = render(ask.template, rng), (ask.tool,)
    elif index % 2 == 0:
        ask = TWIN_ASKS[index // 2 % len(TWIN_ASKS)]
        user, expected = render(ask.template, rng), (ask.tool, ask.tool)
    else:
        first = rng.choice(ASKS)
        second = rng.choice([a for a in ASKS if a.tool != first.tool])
        pairing = rng.choice(_PAIRINGS)
        user = pairing.format(a=render(first.template, rng), b=render(second.template, rng))
        expected = (first.tool, second.tool)
    return ToolCase(f"{kind}-{index:03d}", kind, _tool_set(expected, rng), _messages(user, rng), expected)


def build_cases(num_cases: int | None = None, seed: int = 0) -> list[ToolCase]:
    """The bench's cases, the kinds interleaved (single, enum, nested, parallel, single, ...) so
    any prefix is balanced; `num_cases` keeps the first N (None: all 224)."""
    per_kind = {kind: [_case(kind, i, seed) for i in range(count)] for kind, count in DEFAULT_CASES.items()}
    ordered: list[ToolCase] = []
    for i in range(max(DEFAULT_CASES.values())):
        ordered += [per_kind[kind][i] for kind in KINDS if i < len(per_kind[kind])]
    if num_cases is not None:
        if num_cases < 1:
            raise ValueError(f"--num-cases must be >= 1, got {num_cases}")
        ordered = ordered[:num_cases]
    return ordered


def unused_placeholders() -> list[str]:
    """Placeholders no slot pool fills (a check for the tests; empty when the tables agree)."""
    missing = []
    for ask in (*ASKS, *TWIN_ASKS):
        for field in string.Formatter().parse(ask.template):
            name = field[1]
            if name is not None and _PLACEHOLDER.fullmatch("{" + name + "}") is None:
                missing.append(f"{ask.tool}: {{{name}}}")
        for match in _PLACEHOLDER.finditer(ask.template):
            if match.group(1) not in SLOTS:
                missing.append(f"{ask.tool}: {match.group(0)}")
    return missing
