"""Code problems graded by running their tests: a small Python function to write, with hidden
asserts computed from a reference solution here (the answer's code block is run against them by
``sandbox``). Each problem is a template with parameters drawn from the seed, so the set varies
in names, constants and difficulty (one-liners to loops with edge cases)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from cascade.eval.scoring import Task

CODE_MAX_TOKENS = 128  # a function in a fenced block


@dataclass(frozen=True)
class _Problem:
    name: str
    signature: str  # "(xs)"
    spec: str  # what it returns, in words
    solution: Callable
    cases: list[tuple]  # argument tuples


def _vowels(s):
    return sum(c in "aeiouAEIOU" for c in s)


def _rle(s):
    out, i = "", 0
    while i < len(s):
        j = i
        while j < len(s) and s[j] == s[i]:
            j += 1
        out += f"{s[i]}{j - i}"
        i = j
    return out


def _is_prime(n):
    return n > 1 and all(n % d for d in range(2, int(n ** 0.5) + 1))


def _second_largest(xs):
    return sorted(set(xs))[-2]


def _max_subarray(xs):
    best = cur = xs[0]
    for x in xs[1:]:
        cur = max(x, cur + x)
        best = max(best, cur)
    return best


def _dedupe(xs):
    seen, out = set(), []
    for x in xs:
        if x not in seen:
            seen.add(x)
            out.append(x)
    return out


def _caesar(s, k):
    return "".join(chr((ord(c) - 97 + k) % 26 + 97) if c.islower() else c for c in s)


def _fib(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


def _gcd(a, b):
    while b:
        a, b = b, a % b
    return a


def _words(rng: random.Random, k: int) -> list[str]:
    pool = ["apple", "kiwi", "banana", "fig", "cherry", "plum", "mango", "pear", "lime", "grape", "melon", "date"]
    return [rng.choice(pool) for _ in range(k)]


def _ints(rng: random.Random, k: int, lo: int = -20, hi: int = 20) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(k)]


def _problems(rng: random.Random) -> list[Callable[[], _Problem]]:
    k, m = rng.randint(2, 9), rng.randint(3, 7)
    lo, hi = sorted(rng.sample(range(-10, 30), 2))
    return [
        lambda: _Problem("add_k", "(x)", f"x plus {k}", lambda x: x + k, [(v,) for v in _ints(rng, 4)]),
        lambda: _Problem("clamp", "(x)", f"x limited to the range {lo}..{hi} (inclusive)",
                         lambda x: max(lo, min(hi, x)), [(v,) for v in [lo - 5, hi + 3, (lo + hi) // 2, lo, hi]]),
        lambda: _Problem("count_vowels", "(s)", "the number of vowels (a, e, i, o, u, either case) in the string s",
                         _vowels, [(w,) for w in ["Hello World", "", "AEIOUxyz", " ".join(_words(rng, 3))]]),
        lambda: _Problem("reverse_words", "(s)", "the words of s in reverse order, joined by single spaces",
                         lambda s: " ".join(s.split()[::-1]), [(" ".join(_words(rng, n)),) for n in (1, 3, 5)]),
        lambda: _Problem("is_palindrome", "(s)", "True if s reads the same backwards ignoring case, else False",
                         lambda s: s.lower() == s.lower()[::-1], [("Level",), ("abc",), ("",), ("Noon",), ("ab",)]),
        lambda: _Problem("sum_multiples", "(n)", f"the sum of the positive integers below n divisible by {k} or {m}",
                         lambda n: sum(i for i in range(1, n) if i % k == 0 or i % m == 0),
                         [(n,) for n in (1, 10, 30, rng.randint(40, 200))]),
        lambda: _Problem("second_largest", "(xs)", "the second largest distinct value in the list xs",
                         _second_largest, [(_ints(rng, 6) + [50, 49],), ([3, 3, 1],), ([5, 9],)]),
        lambda: _Problem("rle", "(s)", "the run-length encoding of s: each run of a character as the character "
                         "followed by its count, e.g. 'aab' -> 'a2b1'", _rle,
                         [("aab",), ("",), ("zzzzyzz",), ("abc",)]),
        lambda: _Problem("digit_sum", "(n)", "the sum of the decimal digits of the non-negative integer n",
                         lambda n: sum(map(int, str(n))), [(0,), (7,), (rng.randint(100, 99999),), (9999,)]),
        lambda: _Problem("is_prime", "(n)", "True if the integer n is prime, else False", _is_prime,
                         [(n,) for n in (0, 1, 2, 9, 13, 25, rng.choice([97, 89, 83]), 91)]),
        lambda: _Problem("flatten", "(xss)", "one list with the items of the lists in xss, in order",
                         lambda xss: [x for xs in xss for x in xs], [([[1, 2], [], [k]],), ([],), ([[m], [m, k]],)]),
        lambda: _Problem("max_subarray", "(xs)", "the largest sum of a contiguous non-empty slice of the list xs",
                         _max_subarray, [(_ints(rng, 8),), ([-3, -1, -2],), ([2, -1, 2],), ([5],)]),
        lambda: _Problem("dedupe", "(xs)", "the list xs without repeated items, keeping the first occurrences "
                         "in order", _dedupe, [(_ints(rng, 8, 0, 4),), ([],), (_words(rng, 5),)]),
        lambda: _Problem("caesar", "(s)", f"s with every lowercase letter shifted {k} places forward in the "
                         "alphabet (wrapping from z to a), other characters unchanged",
                         lambda s: _caesar(s, k), [("abc xyz",), ("Hello!",), ("",)]),
        lambda: _Problem("fib", "(n)", "the n-th Fibonacci number, with fib(0) = 0 and fib(1) = 1", _fib,
                         [(0,), (1,), (m,), (rng.randint(15, 30),)]),
        lambda: _Problem("gcd", "(a, b)", "the greatest common divisor of the positive integers a and b", _gcd,
                         [(12, 18), (k * 7, k * 5), (17, 5), (m * 6, m * 4)]),
        lambda: _Problem("count_longer", "(s)", f"the number of words in s longer than {m - 1} characters",
                         lambda s: sum(len(w) > m - 1 for w in s.split()), [(" ".join(_words(rng, 6)),), ("",)]),
        lambda: _Problem("mean_of_evens", "(xs)", "the mean of the even numbers in the list xs as a float "
                         "(0.0 when there are none)",
                         lambda xs: (sum(e := [x for x in xs if x % 2 == 0]) / len(e)) if any(x % 2 == 0 for x in xs)
                         else 0.0, [(_ints(rng, 7, 0, 30),), ([1, 3],), ([2],)]),
    ]


def code_task(rng: random.Random) -> Task:
    """One problem: the prompt names the function and says what it returns; the hidden asserts
    check it on a few cases (edge cases among them)."""
    problem = rng.choice(_problems(rng))()
    fn = problem.name
    asserts = "\n".join(f"assert {fn}({', '.join(map(repr, args))}) == {problem.solution(*args)!r}"
                        for args in problem.cases)
    prompt = (f"Write a Python function `{fn}{problem.signature}` that returns {problem.spec}. "
              "Reply with only the code in a ```python block.")
    return Task(prompt, None, "code", tests=asserts, max_tokens=CODE_MAX_TOKENS)
