"""Shared by the engine-integration tests: the real aggregator, counting the calls that report to it."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from witcert.integrations.telemetry.aggregator import AggregatorSnapshot, CertificateAggregator

_SNAPSHOT_ARRAYS = (
    "samples",
    "covered",
    "vacuous",
    "inf",
    "nan",
    "fallbacks",
    "repaired_bytes",
    "histogram_counts",
    "histogram_sum",
    "histogram_min",
    "histogram_max",
    "raw_layer",
    "raw_head",
    "raw_step",
    "raw_value",
)


class CountingAggregator(CertificateAggregator):
    """A ``CertificateAggregator`` that counts its ``observe`` and ``observe_layers`` calls (one launch each)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: Counter[str] = Counter()

    def observe(self, *args: Any, **kwargs: Any) -> None:
        self.calls["observe"] += 1
        super().observe(*args, **kwargs)

    def observe_layers(self, *args: Any, **kwargs: Any) -> None:
        self.calls["observe_layers"] += 1
        super().observe_layers(*args, **kwargs)


def assert_same_counts(ours: AggregatorSnapshot, reference: AggregatorSnapshot, skip: tuple[str, ...] = ()) -> None:
    """Every counter, histogram and raw sample of ``ours`` equals ``reference``'s (fields in ``skip`` aside)."""
    assert ours.step == reference.step
    assert ours.raw_written == reference.raw_written
    for name in _SNAPSHOT_ARRAYS:
        if name not in skip:
            np.testing.assert_array_equal(getattr(ours, name), getattr(reference, name), err_msg=name)
