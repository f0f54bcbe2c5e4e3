"""What the receivers, the read API and mounted pages exchange with the collector's pipeline.

The types live apart from the pipeline and the servers so that each of those imports them and
none imports another (``service`` wires receivers to the pipeline; nothing imports ``service``
back).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from witcert.collector.queries import Queries


@dataclass(frozen=True)
class ApiRequest:
    """A read-only GET request as a mounted route sees it; ``queries`` reads the store."""

    path: str
    params: Mapping[str, str]
    headers: Mapping[str, str]
    queries: Queries


@dataclass(frozen=True)
class ApiResponse:
    status: int
    content_type: str
    body: bytes
    headers: Mapping[str, str] = field(default_factory=dict)


RouteHandler = Callable[[ApiRequest], ApiResponse]


@dataclass(frozen=True)
class Route:
    """GET requests whose path equals ``prefix`` or starts with ``prefix + '/'`` go to ``handler``."""

    prefix: str
    handler: RouteHandler


class Outcome(Enum):
    ACCEPTED = "accepted"
    DUPLICATE = "duplicate"  # a client retry of a request already spooled: acknowledged again
    INVALID = "invalid"  # undecodable body: 400 / INVALID_ARGUMENT
    TOO_LARGE = "too large"  # beyond a size cap or the whole memory budget: 413 / RESOURCE_EXHAUSTED
    UNAVAILABLE = "unavailable"  # spool full, store down too long, budget in use: 503 / UNAVAILABLE + retry


@dataclass(frozen=True)
class IngestResult:
    outcome: Outcome
    message: str = ""
    accepted_points: int = 0
    rejected_points: int = 0
