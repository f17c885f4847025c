"""How good an answer is, for calibration: exact match where the task has an answer, the hidden
asserts run against the answer's code for a code problem (``sandbox``), else the token F1 of the
edge answer against the cloud's. One module, so every tool scores alike."""

from __future__ import annotations

import re
import string
import unicodedata
from collections import Counter
from dataclasses import dataclass

_PUNCT = str.maketrans("", "", string.punctuation.replace(".", "").replace("-", ""))
_NUM = re.compile(r"-?\d+(?:\.\d+)?")


def normalize(text: str) -> str:
    """Lower case, no accents (Bogotá = Bogota), no punctuation but '.' and '-', single spaces."""
    text = "".join(c for c in unicodedata.normalize("NFKD", text) if not unicodedata.combining(c))
    text = text.lower().translate(_PUNCT)
    return " ".join(text.split())


def tokens(text: str) -> list[str]:
    return normalize(text).replace(".", " ").split()


def token_f1(candidate: str, reference: str) -> float:
    """SQuAD-style token F1 (1.0 for two empty answers)."""
    a, b = tokens(candidate), tokens(reference)
    if not a or not b:
        return float(a == b)
    common = sum((Counter(a) & Counter(b)).values())
    if not common:
        return 0.0
    p, r = common / len(a), common / len(b)
    return 2 * p * r / (p + r)


@dataclass(frozen=True)
class Task:
    """A prompt and, when it has one, how to check an answer."""

    prompt: str
    answer: str | None = None  # the expected answer
    kind: str = "open"  # arithmetic | conversion | fact | format | extraction | python | code | open
    tests: str | None = None  # code: hidden asserts the answer's code block must pass
    max_tokens: int = 32  # the answer length this kind needs (code: a function)

    def score(self, response: str, reference: str | None = None) -> float:
        """1/0 against ``answer`` (or, for code, ``tests`` run against the answer's code block);
        else token F1 against ``reference`` (the cloud's answer)."""
        if self.tests is not None:
            from cascade.eval.sandbox import grade

            return grade(response, self.tests)
        if self.answer is None:
            return token_f1(response, reference or "")
        return float(matches(response, self.answer, numeric=self.kind in ("arithmetic", "conversion", "python")))


def matches(response: str, answer: str, numeric: bool = False) -> bool:
    """Whether the answer is given: the first number for numeric tasks, else the normalized
    answer as a whole word(s) in the response's first line."""
    first = response.strip().splitlines()[0] if response.strip() else ""
    if numeric:
        m = _NUM.search(first.replace(",", ""))
        return m is not None and abs(float(m.group()) - float(answer)) < 1e-6
    if answer.isupper():  # a formatting task asks for the exact case
        return answer in first
    return re.search(rf"\b{re.escape(normalize(answer))}\b", normalize(first)) is not None
