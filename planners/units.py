"""How reports write counts and seconds (bytes: `planners.inputs.format_bytes`)."""

from __future__ import annotations

__all__ = ["format_seconds", "plural", "time_unit"]


def plural(count: int, word: str, many: str | None = None) -> str:
    """'1 table', '2 tables' (`many` for irregular plurals)."""
    return f"{count} {word if count == 1 else (many or word + 's')}"


def time_unit(seconds: float) -> tuple[str, float]:
    """The unit to show `seconds` and smaller values in: ms, or us below 1 ms, or ns below
    1 us, so that a small plan does not read 0.000 ms everywhere."""
    if seconds >= 1e-3:
        return ("ms", 1e3)
    return ("us", 1e6) if seconds >= 1e-6 else ("ns", 1e9)


def format_seconds(seconds: float) -> str:
    """0.00123 -> '1.230 ms'; 3.1e-6 -> '3.10 us'."""
    unit, scale = time_unit(seconds)
    return f"{scale * seconds:.3f} {unit}" if unit == "ms" else f"{scale * seconds:.2f} {unit}"
