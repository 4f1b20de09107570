"""Prometheus metrics: counters kept in memory and gauges read from the store at scrape time."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from switchboard.configuration import WAL_LIMIT_BYTES
from switchboard.database import Database
from switchboard.doorbell import Doorbell
from switchboard.store.forge_outbox import pending_outputs
from switchboard.store.upkeep import queue_stats


class Metrics:
    """Prometheus text through prometheus_client, one registry per app. Counters the HTTP layer sees are kept
    here; what the store counted and what the database holds are collected at scrape time. No queue name or
    id appears: /metrics is for the operator, and tenants' names stay out of it."""

    def __init__(self, db: Database, doorbell: Doorbell) -> None:
        disable_created_metrics()
        self.registry = CollectorRegistry()
        self.deliveries = Counter("switchboard_deliveries", "Deliveries answered, by provider and verdict",
                                  ["provider", "verdict"], registry=self.registry)
        self.verification_failures = Counter("switchboard_verification_failures",
                                             "Deliveries refused at verification, by reason",
                                             ["provider", "reason"], registry=self.registry)
        self.routing = Counter("switchboard_routing_decisions", "Routing decisions, by stage and disposition",
                               ["stage", "disposition"], registry=self.registry)
        self.faults = Counter("switchboard_rule_faults", "Rule faults that held a delivery, by cause", ["cause"],
                              registry=self.registry)
        self.shed = Counter("switchboard_deliveries_shed", "Deliveries answered 503 (Retry-After) and not stored:"
                            " their owner's rules found no evaluator in time", ["provider"], registry=self.registry)
        self.notify_sent = Counter("switchboard_notify_sent", "Notifications delivered, by channel kind", ["kind"],
                                   registry=self.registry)
        self.notify_failures = Counter("switchboard_notify_failures", "Notification sends that failed, by channel"
                                       " kind", ["kind"], registry=self.registry)
        self.forge_outputs = Counter("switchboard_forge_outputs", "Forge outputs that reached an end, by type and state"
                                     " (sent, failed)", ["type", "state"], registry=self.registry)
        self.forge_status = Counter("switchboard_forge_status_comments", "Status comment writes, by result",
                                    ["result"], registry=self.registry)
        self.registry.register(_StoreCollector(db, doorbell))

    def count_delivery(self, provider: str, outcome: dict, trace: dict) -> None:
        if outcome.get("duplicate"):
            self.deliveries.labels(provider, "duplicate").inc()
            return
        self.deliveries.labels(provider, outcome["disposition"]).inc()
        self.routing.labels(trace["stage"], outcome["disposition"]).inc()
        if trace["stage"] == "fault":
            self.faults.labels(trace["cause"]).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StoreCollector(Collector):
    def __init__(self, db: Database, doorbell: Doorbell):
        self.db = db
        self.doorbell = doorbell

    def collect(self) -> Iterable[Any]:
        stats = self.db.read_sync(queue_stats)
        depth = GaugeMetricFamily("switchboard_todos", "Todos by state", labels=["state"])
        for state, count in stats["depth"].items():
            depth.add_metric([state], count)
        yield depth
        yield GaugeMetricFamily("switchboard_oldest_pending_seconds", "Age of the oldest claimable pending todo",
                                value=stats["oldest_pending_seconds"])
        with self.db.counts_lock:
            counts = dict(self.db.counts)
        yield CounterMetricFamily("switchboard_todos_created", "Todos created", value=counts.get("created", 0))
        yield CounterMetricFamily("switchboard_todos_claimed", "Claims granted", value=counts.get("claimed", 0))
        completed = CounterMetricFamily("switchboard_todos_completed", "Todos done, by outcome", labels=["outcome"])
        for outcome in ("completed", "approved", "absorbed", "discarded"):
            completed.add_metric([outcome], counts.get(f"completed:{outcome}", 0))
        yield completed
        yield CounterMetricFamily("switchboard_lease_expiries", "Leases that lapsed",
                                  value=counts.get("lease_expired", 0))
        accepted = CounterMetricFamily("switchboard_forge_outputs_accepted", "Forge outputs accepted, by type",
                                       labels=["type"])
        pending = GaugeMetricFamily("switchboard_forge_outputs_pending", "Forge outputs not yet sent, by type",
                                    labels=["type"])
        for kind, count in self.db.read_sync(pending_outputs).items():
            accepted.add_metric([kind], counts.get(f"output_accepted:{kind}", 0))
            pending.add_metric([kind], count)
        yield accepted
        yield pending
        rings = CounterMetricFamily("switchboard_doorbell_rings", "Rings, by whether a session heard them",
                                    labels=["heard"])
        rings.add_metric(["true"], self.doorbell.rung)
        rings.add_metric(["false"], self.doorbell.unheard)
        yield rings
        yield CounterMetricFamily("switchboard_doorbell_rings_passed_on", "Rings a waiting claim took and did not use"
                                  " (it claimed another todo), rung again for the next session; counted in the rings"
                                  " too", value=self.doorbell.passed_on)
        if self.db.engine == "sqlite":  # Postgres's WAL is the server's to watch (pg_stat_wal)
            wal = Path(self.db.path + "-wal")
            yield GaugeMetricFamily("switchboard_wal_bytes", "Size of the write-ahead log file",
                                    value=wal.stat().st_size if wal.exists() else 0)
            yield GaugeMetricFamily("switchboard_wal_limit_bytes", "The WAL size a checkpoint truncates back to",
                                    value=WAL_LIMIT_BYTES)
