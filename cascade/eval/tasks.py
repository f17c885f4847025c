"""A generated evaluation set with checkable answers: arithmetic, unit conversion, short facts
from a table shipped here, and formatting instructions. Deterministic for a seed."""

from __future__ import annotations

import random

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


def generate(n: int, seed: int = 0) -> list[Task]:
    """``n`` tasks, a mix of the kinds, the same for the same seed."""
    rng = random.Random(seed)
    makers = [_arithmetic, _conversion, _capital, _symbol, _opposite, _format]
    return [rng.choice(makers)(rng) for _ in range(n)]


def _arithmetic(rng: random.Random) -> Task:
    a, b = rng.randint(2, 60), rng.randint(2, 60)
    op = rng.choice("+-*")
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    return Task(f"What is {a} {op} {b}? Answer with just the number.", str(value), "arithmetic")


def _conversion(rng: random.Random) -> Task:
    big, small, factor = rng.choice(CONVERSIONS)
    k = rng.randint(2, 9)
    return Task(f"How many {small} are in {k} {big}? Answer with just the number.", str(k * factor), "conversion")


def _capital(rng: random.Random) -> Task:
    country = rng.choice(sorted(CAPITALS))
    return Task(f"What is the capital of {country}? Answer with just the city.", CAPITALS[country], "fact")


def _symbol(rng: random.Random) -> Task:
    element = rng.choice(sorted(SYMBOLS))
    return Task(f"What is the chemical symbol for {element}? Answer with just the symbol.", SYMBOLS[element], "fact")


def _opposite(rng: random.Random) -> Task:
    word = rng.choice(sorted(OPPOSITES))
    return Task(f"What is the opposite of '{word}'? Answer with one word.", OPPOSITES[word], "fact")


def _format(rng: random.Random) -> Task:
    word = rng.choice(WORDS)
    return Task(f"Write the word '{word}' in uppercase letters, and nothing else.", word.upper(), "format")
