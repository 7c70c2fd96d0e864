"""'Did you mean ...?' for misspelt table names, fields and constraints."""

from __future__ import annotations

from typing import Iterable

__all__ = ["closest", "did_you_mean"]

# Characters people type for one another: a substitution between them costs less than a typo.
_CONFUSABLE = {frozenset(p) for p in ("O0", "o0", "l1", "I1", "-_", " _")}


def _sub_cost(a: str, b: str) -> float:
    if a == b:
        return 0.0
    if a.lower() == b.lower() or frozenset((a, b)) in _CONFUSABLE:
        return 0.3
    return 1.0


def _distance(a: str, b: str) -> float:
    """Edit distance with cheap substitutions of look-alike characters."""
    prev = [float(j) for j in range(len(b) + 1)]
    for i, ca in enumerate(a, 1):
        cur = [float(i)]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + _sub_cost(ca, cb)))
        prev = cur
    return prev[-1]


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The choice nearest to `word`, if it is near enough to be what was meant."""
    best, best_d = None, float("inf")
    for c in dict.fromkeys(choices):
        d = _distance(word, c)
        if d < best_d:
            best, best_d = c, d
    limit = max(1.0, 0.34 * len(word))
    return best if best is not None and 0 < best_d <= limit else None


def did_you_mean(word: str, choices: Iterable[str], end: str = "?") -> str:
    """"did you mean 'user_id'?" or ''."""
    match = closest(word, choices)
    return f"did you mean {match!r}{end}" if match else ""
