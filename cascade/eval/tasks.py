"""A generated, graded evaluation set: each task has a checkable grade. Arithmetic of graded
difficulty (one digit to multi-step word problems), unit conversion, short facts from tables
shipped here, extraction (a field from generated text, JSON or a list), formatting, and small
Python functions graded by running hidden asserts (``code_tasks``). Deterministic for a seed."""

from __future__ import annotations

import json
import random

from cascade.eval.code_tasks import code_task
from cascade.eval.scoring import Task

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Japan": "Tokyo",
    "China": "Beijing", "Russia": "Moscow", "Egypt": "Cairo", "Canada": "Ottawa", "Australia": "Canberra",
    "Brazil": "Brasilia", "Argentina": "Buenos Aires", "Mexico": "Mexico City", "India": "New Delhi",
    "Kenya": "Nairobi", "Norway": "Oslo", "Sweden": "Stockholm", "Finland": "Helsinki", "Poland": "Warsaw",
    "Greece": "Athens", "Portugal": "Lisbon", "Ireland": "Dublin", "Austria": "Vienna", "Hungary": "Budapest",
    "Peru": "Lima", "Chile": "Santiago", "Thailand": "Bangkok", "Vietnam": "Hanoi", "Turkey": "Ankara",
    "Iran": "Tehran", "Cuba": "Havana", "Denmark": "Copenhagen", "Belgium": "Brussels",
    "Netherlands": "Amsterdam", "Switzerland": "Bern", "South Korea": "Seoul", "Colombia": "Bogota",
    "Nigeria": "Abuja", "Morocco": "Rabat", "Ukraine": "Kyiv",
}
SYMBOLS = {
    "hydrogen": "H", "helium": "He", "carbon": "C", "nitrogen": "N", "oxygen": "O", "sodium": "Na",
    "iron": "Fe", "gold": "Au", "silver": "Ag", "copper": "Cu", "potassium": "K", "calcium": "Ca",
    "lead": "Pb", "tin": "Sn", "zinc": "Zn", "mercury": "Hg", "sulfur": "S", "chlorine": "Cl",
    "neon": "Ne", "uranium": "U",
}
OPPOSITES = {"hot": "cold", "up": "down", "big": "small", "fast": "slow", "day": "night", "open": "closed",
             "happy": "sad", "light": "dark", "early": "late", "full": "empty", "old": "new", "win": "lose"}
CONVERSIONS = [("meters", "centimeters", 100), ("kilometers", "meters", 1000), ("hours", "minutes", 60),
               ("minutes", "seconds", 60), ("kilograms", "grams", 1000), ("days", "hours", 24),
               ("feet", "inches", 12), ("weeks", "days", 7), ("liters", "milliliters", 1000)]
WORDS = ["apple", "river", "table", "garden", "rocket", "violin", "pencil", "window", "tiger", "cloud"]


NAMES = ["Ana", "Bruno", "Chen", "Dara", "Emeka", "Farah", "Goran", "Hana", "Ivan", "Jules", "Kofi", "Lena"]
ITEMS = ["apples", "pencils", "tickets", "cards", "stamps", "marbles", "cookies", "books"]
COURIERS = ["Nova", "Swift", "Atlas", "Polar", "Orbit", "Comet"]
LEGS = {"spider": 8, "insect": 6, "dog": 4, "bird": 2, "octopus": 8, "horse": 4, "ant": 6, "crab": 10}
SIDES = {"triangle": 3, "square": 4, "pentagon": 5, "hexagon": 6, "heptagon": 7, "octagon": 8, "decagon": 10}


def generate(n: int, seed: int = 0) -> list[Task]:
    """``n`` tasks, a mix of the kinds and difficulties, the same for the same seed."""
    rng = random.Random(seed)
    makers, weights = zip(*_MIX, strict=True)
    return [rng.choices(makers, weights)[0](rng) for _ in range(n)]


def _num(question: str, value: int | float, kind: str = "arithmetic") -> Task:
    return Task(f"{question} Answer with just the number.", str(value), kind)


def _arithmetic(rng: random.Random) -> Task:
    """Level 1 (one digit) to 4 (three digits times two)."""
    level = rng.randint(1, 4)
    hi = {1: 9, 2: 60, 3: 99, 4: 999}[level]
    a, b = rng.randint(2, hi), rng.randint(2, hi if level < 3 else 99 if level == 4 else 12)
    op = rng.choice("+-*")
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    return _num(f"What is {a} {op} {b}?", value)


def _multi_step(rng: random.Random) -> Task:
    a, b, c, d = (rng.randint(2, 20) for _ in range(4))
    form = rng.randrange(3)
    if form == 0:
        return _num(f"What is ({a} + {b}) * {c} - {d}?", (a + b) * c - d)
    if form == 1:
        return _num(f"What is {a} * {b} + {c} * {d}?", a * b + c * d)
    return _num(f"What is {a * c} / {c} + {b} - {d}?", a + b - d)


def _word_problem(rng: random.Random) -> Task:
    who, what = rng.choice(NAMES), rng.choice(ITEMS)
    a, b, c = rng.randint(5, 40), rng.randint(2, 9), rng.randint(1, 4)
    form = rng.randrange(3)
    if form == 0:
        return _num(f"{who} has {a} {what} and buys {b} packs of {c} more. How many {what} does {who} have now?",
                    a + b * c)
    if form == 1:
        return _num(f"{who} has {a + b * c} {what}, gives {b} friends {c} each. How many are left?", a)
    extra = rng.randint(1, b - 1)  # a partly filled last box
    return _num(f"A box holds {b} {what}. How many boxes are needed for {a * b + extra} {what}?", a + 1)


def _conversion(rng: random.Random) -> Task:
    big, small, factor = rng.choice(CONVERSIONS)
    form = rng.randrange(3)
    if form == 0:
        k = rng.randint(2, 9)
        return _num(f"How many {small} are in {k} {big}?", k * factor, "conversion")
    if form == 1:
        k = rng.randint(1, 9) + 0.5
        value = k * factor
        return _num(f"How many {small} are in {k} {big}?", int(value) if value.is_integer() else value, "conversion")
    k = rng.randint(2, 9)
    return _num(f"How many {big} are {k * factor} {small}?", k, "conversion")


def _temperature(rng: random.Random) -> Task:
    c = rng.choice(range(-40, 105, 5))
    return _num(f"Convert {c} degrees Celsius to Fahrenheit.", c * 9 // 5 + 32, "conversion")


def _capital(rng: random.Random) -> Task:
    country = rng.choice(sorted(CAPITALS))
    return Task(f"What is the capital of {country}? Answer with just the city.", CAPITALS[country], "fact")


def _symbol(rng: random.Random) -> Task:
    element = rng.choice(sorted(SYMBOLS))
    return Task(f"What is the chemical symbol for {element}? Answer with just the symbol.", SYMBOLS[element], "fact")


def _opposite(rng: random.Random) -> Task:
    word = rng.choice(sorted(OPPOSITES))
    return Task(f"What is the opposite of '{word}'? Answer with one word.", OPPOSITES[word], "fact")


def _count_fact(rng: random.Random) -> Task:
    if rng.random() < 0.5:
        animal = rng.choice(sorted(LEGS))
        return _num(f"How many legs does a {animal} have?", LEGS[animal], "fact")
    shape = rng.choice(sorted(SIDES))
    k = rng.randint(1, 3)
    return _num(f"How many sides do {k} {shape}s have in total?", k * SIDES[shape], "fact")


def _format(rng: random.Random) -> Task:
    word = rng.choice(WORDS)
    form = rng.randrange(3)
    if form == 0:
        return Task(f"Write the word '{word}' in uppercase letters, and nothing else.", word.upper(), "format")
    if form == 1:
        return Task(f"Write the word '{word}' backwards, letter by letter, as one word and nothing else.",
                    word[::-1], "format")
    words = rng.sample(WORDS, rng.randint(3, 5))
    return Task(f"Sort these words alphabetically and write them on one line separated by spaces: "
                f"{', '.join(words)}.", " ".join(sorted(words)), "format")


def _python_value(rng: random.Random) -> Task:
    """What a short Python expression evaluates to (what a coder model should know)."""
    a, b = rng.randint(2, 30), rng.randint(2, 9)
    items = [rng.randint(0, 9) for _ in range(rng.randint(2, 6))]
    expr, value = rng.choice([(f"len({items})", len(items)), (f"{a} // {b}", a // b), (f"{a} % {b}", a % b),
                              (f"sum(range({b}))", sum(range(b))), (f"{b} ** 2", b ** 2),
                              (f"max({items}) - min({items})", max(items) - min(items)),
                              (f"sorted({items})[1]", sorted(items)[1])])
    return Task(f"In Python, what does {expr} return? Answer with just the number.", str(value), "python")


def _extract_json(rng: random.Random) -> Task:
    record = {"id": rng.randint(1000, 9999), "name": rng.choice(NAMES), "city": rng.choice(sorted(CAPITALS.values())),
              "items": rng.randint(1, 50), "courier": rng.choice(COURIERS)}
    nested = rng.random() < 0.4
    doc = {"order": record, "status": "shipped"} if nested else record
    key = rng.choice(sorted(record))
    where = f'"order" -> "{key}"' if nested else f'"{key}"'
    return Task(f"Here is a JSON document: {json.dumps(doc)}\nWhat is the value of {where}? "
                "Answer with just the value.", str(record[key]), "extraction")


def _extract_text(rng: random.Random) -> Task:
    order, who, city = rng.randint(1000, 9999), rng.choice(NAMES), rng.choice(sorted(CAPITALS.values()))
    courier, n = rng.choice(COURIERS), rng.randint(2, 30)
    text = (f"Order {order} for {who} left the warehouse on a {courier} truck with {n} parcels, "
            f"bound for {city}.")
    field, answer = rng.choice([("order number", order), ("courier", courier), ("destination city", city),
                                ("number of parcels", n), ("customer name", who)])
    return Task(f"{text}\nWhat is the {field}? Answer with just the value.", str(answer), "extraction")


def _extract_list(rng: random.Random) -> Task:
    words = rng.sample(WORDS + sorted(OPPOSITES), rng.randint(4, 8))
    k = rng.randint(1, len(words))
    ordinal = {1: "first", 2: "second", 3: "third", 4: "fourth", 5: "fifth", 6: "sixth", 7: "seventh",
               8: "eighth"}[k]
    return Task(f"Here is a list: {', '.join(words)}. What is the {ordinal} item? Answer with just the word.",
                words[k - 1], "extraction")


_MIX = [(_arithmetic, 6), (_multi_step, 4), (_word_problem, 4), (_conversion, 4), (_temperature, 1),
        (_capital, 3), (_symbol, 2), (_opposite, 1), (_count_fact, 2), (_format, 4), (_extract_json, 3),
        (_extract_text, 3), (_extract_list, 2), (_python_value, 3), (code_task, 10)]
