"""Human-readable quantities for command-line output."""

from __future__ import annotations


def format_size(n: float) -> str:
    """Bytes in decimal units: ``512 B``, ``1.5 KB``, ``82.3 MB``, ``1.2 GB``."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)
