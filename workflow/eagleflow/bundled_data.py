"""The bundled chat dataset: deterministic multi-turn conversations from a few task families.

Each family has structure a small model can learn (arithmetic, counting, sorting, lookups,
spelling), and follow-up turns refer back to the previous answer, so the data is
multi-turn in substance, not only in shape. Same seed, same bytes.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

CAPITALS = {
    "France": "Paris", "Japan": "Tokyo", "Kenya": "Nairobi", "Peru": "Lima",
    "Canada": "Ottawa", "Egypt": "Cairo", "Norway": "Oslo", "Chile": "Santiago",
    "India": "New Delhi", "Spain": "Madrid", "Italy": "Rome", "Ghana": "Accra",
    "Cuba": "Havana", "Nepal": "Kathmandu", "Poland": "Warsaw", "Greece": "Athens",
}
WORDS = [
    "apple", "river", "stone", "garden", "cloud", "violet", "engine", "harbor", "lemon",
    "marble", "forest", "candle", "pepper", "silver", "tiger", "window", "planet", "orange",
    "bridge", "rocket", "meadow", "copper", "falcon", "island",
]
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def _arithmetic(rng: random.Random) -> list[dict]:
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    turns = [
        {"role": "user", "content": f"What is {a} plus {b}?"},
        {"role": "assistant", "content": f"{a} plus {b} is {a + b}."},
    ]
    if rng.random() < 0.5:
        c = rng.randint(2, 9)
        turns += [
            {"role": "user", "content": f"Now multiply that by {c}."},
            {"role": "assistant", "content": f"{a + b} times {c} is {(a + b) * c}."},
        ]
    return turns


def _counting(rng: random.Random) -> list[dict]:
    start = rng.randint(1, 40)
    stop = start + rng.randint(3, 12)
    seq = ", ".join(str(i) for i in range(start, stop + 1))
    turns = [
        {"role": "user", "content": f"Count from {start} to {stop}."},
        {"role": "assistant", "content": f"{seq}."},
    ]
    if rng.random() < 0.4:
        back = ", ".join(str(i) for i in range(stop, start - 1, -1))
        turns += [
            {"role": "user", "content": "Now count back down."},
            {"role": "assistant", "content": f"{back}."},
        ]
    return turns


def _sorting(rng: random.Random) -> list[dict]:
    words = rng.sample(WORDS, rng.randint(3, 6))
    return [
        {"role": "user", "content": "Sort these words alphabetically: " + " ".join(words)},
        {"role": "assistant", "content": "In alphabetical order: " + " ".join(sorted(words)) + "."},
    ]


def _capitals(rng: random.Random) -> list[dict]:
    countries = rng.sample(sorted(CAPITALS), rng.randint(1, 3))
    turns = []
    for i, country in enumerate(countries):
        question = f"What is the capital of {country}?" if i == 0 else f"And of {country}?"
        turns += [
            {"role": "user", "content": question},
            {"role": "assistant", "content": f"The capital of {country} is {CAPITALS[country]}."},
        ]
    return turns


def _spelling(rng: random.Random) -> list[dict]:
    word = rng.choice(WORDS)
    turns = [
        {"role": "user", "content": f"Spell the word {word} letter by letter."},
        {"role": "assistant", "content": " ".join(word.upper()) + "."},
    ]
    if rng.random() < 0.5:
        turns += [
            {"role": "user", "content": "How many letters is that?"},
            {"role": "assistant", "content": f"{word} has {len(word)} letters."},
        ]
    return turns


def _digits(rng: random.Random) -> list[dict]:
    digits = [rng.randint(0, 9) for _ in range(rng.randint(2, 6))]
    number = "".join(str(d) for d in digits)
    return [
        {"role": "user", "content": f"Write the digits of {number} as words."},
        {"role": "assistant", "content": " ".join(NUMBER_WORDS[d] for d in digits) + "."},
    ]


FAMILIES = {
    "arithmetic": _arithmetic,
    "counting": _counting,
    "sorting": _sorting,
    "capitals": _capitals,
    "spelling": _spelling,
    "digits": _digits,
}


def generate_conversations(n: int, seed: int = 0) -> list[dict]:
    """`n` conversations in OpenAI `messages` form, each tagged with its task family."""
    rng = random.Random(seed)
    names = sorted(FAMILIES)
    rows = []
    for i in range(n):
        family = names[rng.randrange(len(names))]
        rows.append({"id": f"bundled-{i:05d}", "family": family, "messages": FAMILIES[family](rng)})
    return rows


def write_jsonl(rows: list[dict], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        for row in rows:
            f.write(json.dumps(row, sort_keys=True) + "\n")
    tmp.replace(path)
