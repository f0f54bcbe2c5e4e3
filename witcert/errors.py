"""Errors as the one line a command prints: what was wrong, and where possible how to fix it."""

from __future__ import annotations


def one_line(error: BaseException) -> str:
    """``error`` in one line. A pydantic validation error becomes ``field: problem (got value)`` per
    field, without its documentation links; an OS error names the file it concerns."""
    errors = getattr(error, "errors", None)
    if callable(errors) and type(error).__name__ == "ValidationError":
        problems = []
        for issue in errors():
            where = ".".join(str(part) for part in issue.get("loc", ())) or "value"
            message = str(issue.get("msg", "invalid")).removeprefix("Value error, ")
            problems.append(f"{where}: {message} (got {issue.get('input')!r})")
        return "; ".join(problems)
    if isinstance(error, OSError) and error.strerror:
        target = f" {error.filename}" if error.filename else ""
        return f"{error.strerror}:{target}" if target else error.strerror
    return " ".join(str(error).split()) or type(error).__name__
