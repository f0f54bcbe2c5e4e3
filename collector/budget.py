"""The memory budget: bytes that requests may hold while they are received and decoded.

Each request reserves what it is about to allocate (body bytes as they arrive, inflated bytes as
they come out of gzip, a decoded piece before it is parsed) and gives everything back when it is
answered. A reservation that does not fit now fails at once (the client gets 503 and retries);
one larger than the whole budget can never fit (413).
"""

from __future__ import annotations

import threading


class OverBudget(RuntimeError):
    """The reservation does not fit now; ``never`` when it exceeds the whole budget."""

    def __init__(self, message: str, never: bool) -> None:
        super().__init__(message)
        self.never = never


class MemoryBudget:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.peak = 0
        self._lock = threading.Lock()

    def try_acquire(self, amount: int) -> bool:
        with self._lock:
            if self.used + amount > self.limit:
                return False
            self.used += amount
            self.peak = max(self.peak, self.used)
            return True

    def release(self, amount: int) -> None:
        with self._lock:
            self.used -= amount

    def hold(self) -> Hold:
        return Hold(self)


class Hold:
    """One request's reservations, released together by ``release_all`` (or ``with``)."""

    def __init__(self, budget: MemoryBudget) -> None:
        self.budget = budget
        self.amount = 0

    def try_take(self, amount: int) -> bool:
        """Reserve ``amount`` more bytes if they fit now."""
        if not self.budget.try_acquire(amount):
            return False
        self.amount += amount
        return True

    def take(self, amount: int, what: str) -> None:
        """Reserve ``amount`` more bytes for ``what``, or raise OverBudget."""
        if self.try_take(amount):
            return
        limit = self.budget.limit
        if self.amount + amount > limit:
            raise OverBudget(
                f"{what} needs {self.amount + amount} bytes of the collector's memory budget of {limit}: "
                "send smaller requests",
                never=True,
            )
        raise OverBudget(f"the memory budget ({limit} bytes) is in use by other requests", never=False)

    def give_back(self, amount: int) -> None:
        amount = min(amount, self.amount)
        self.amount -= amount
        self.budget.release(amount)

    def release_all(self) -> None:
        self.give_back(self.amount)

    def __enter__(self) -> Hold:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release_all()
