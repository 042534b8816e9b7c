"""The usage buffer's counters on `/metrics`: rows written, dropped and waiting, read at scrape time."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.usage.buffer import UsageBuffer


class UsageCollector(Collector):
    """`tunegate_usage_rows_{written,dropped}_total` and `tunegate_usage_rows_waiting` of one buffer."""

    def __init__(self, buffer: UsageBuffer) -> None:
        self.buffer = buffer

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        yield CounterMetricFamily(
            "tunegate_usage_rows_written", "Usage rows written to the database", value=self.buffer.written
        )
        yield CounterMetricFamily(
            "tunegate_usage_rows_dropped",
            "Usage rows dropped because the buffer was full (the database was unreachable for long)",
            value=self.buffer.dropped,
        )
        yield GaugeMetricFamily(
            "tunegate_usage_rows_waiting",
            "Usage rows in the buffer, not written yet",
            value=self.buffer.pending,
        )
