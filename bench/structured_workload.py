"""The structured-output workload of ``bench/e2e.py``: record extraction into a JSON schema.

Each prompt describes one synthetic customer (deterministic from the seed) in prose and asks for
the record as JSON; the request carries the schema as its grammar. Values are copied from the
prompt and keys repeat across requests, which is where prompt lookup and the shared corpus help.
"""

from __future__ import annotations

import json
import random

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "city": {"type": "string"},
        "country": {"type": "string"},
        "email": {"type": "string"},
        "member_since": {"type": "integer"},
        "plan": {"enum": ["free", "pro", "enterprise"]},
    },
    "required": ["name", "age", "city", "country", "email", "member_since", "plan"],
    "additionalProperties": False,
}
_FIRST = ["Maria", "John", "Aiko", "Lars", "Fatima", "Carlos", "Mei", "Oliver", "Priya", "Tomasz", "Amara", "Lucas"]
_LAST = ["Lopez", "Smith", "Tanaka", "Nilsson", "Haddad", "Silva", "Chen", "Brown", "Patel", "Nowak", "Okafor", "Martin"]
_PLACES = [("Madrid", "Spain"), ("Chicago", "USA"), ("Osaka", "Japan"), ("Gothenburg", "Sweden"), ("Rabat", "Morocco"),
           ("Porto", "Portugal"), ("Shenzhen", "China"), ("Leeds", "UK"), ("Pune", "India"), ("Krakow", "Poland")]
_PLANS = ["free", "pro", "enterprise"]


def records(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        first, last = rng.choice(_FIRST), rng.choice(_LAST)
        city, country = rng.choice(_PLACES)
        out.append({"name": f"{first} {last}", "age": rng.randint(19, 80), "city": city, "country": country,
                    "email": f"{first.lower()}.{last.lower()}@example.com", "member_since": rng.randint(2005, 2025),
                    "plan": rng.choice(_PLANS)})
    return out


def prompt_text(r: dict) -> str:
    return (f"Customer note: {r['name']} is {r['age']} years old and lives in {r['city']}, {r['country']}. "
            f"Contact: {r['email']}. Customer since {r['member_since']}, on the {r['plan']} plan.\n"
            "Extract this customer as a JSON object with the keys name, age, city, country, email, "
            "member_since and plan.")


def prompts(codec, n: int, seed: int = 0) -> list[list[int]]:
    """Chat-templated prompt ids of n records."""
    return [codec.encode(codec.apply_chat_template([{"role": "user", "content": prompt_text(r)}]))
            for r in records(n, seed)]


def valid(text: str) -> bool:
    """The output parses and satisfies the schema (jsonschema when installed, else keys and types)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return False
    try:
        import jsonschema
    except ImportError:
        return isinstance(obj, dict) and set(obj) == set(SCHEMA["required"])
    try:
        jsonschema.validate(obj, SCHEMA)
    except jsonschema.ValidationError:
        return False
    return True
