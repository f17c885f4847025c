"""The ``name=value,...`` lists some config keys hold (reservations, class targets, prices),
split in one place so each key's parser only checks its own numbers."""

from __future__ import annotations

import math
from collections.abc import Iterator


def named_values(text: str) -> Iterator[tuple[str, str, list[float]]]:
    """``name=value,...`` as (item, name, the value's numbers split on ":"), each a float or NaN."""
    for item in (i.strip() for i in text.split(",")):
        if item:
            name, _, value = item.partition("=")
            numbers = []
            for part in value.split(":"):
                try:
                    numbers.append(float(part))
                except ValueError:
                    numbers.append(math.nan)
            yield item, name.strip(), numbers
