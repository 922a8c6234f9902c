"""The workers' Prometheus series in the api's GET /metrics: at each scrape, every live
worker's metrics page (its PAGEDQ_METRICS_PORT, at the address Redis sees it connect
from) is read and the pages summed into one (pagedq.metrics.aggregate_workers). A worker
that does not answer within a second is left out of that scrape; the rest still show.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import httpx
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from pagedq.metrics import aggregate_workers

log = logging.getLogger("pagedq.api")
_SCRAPE_TIMEOUT_S = 1.0


class WorkerSeries(Collector):
    def __init__(self, workers: Callable[[], list[dict]]):
        """`workers`: the live workers (pagedq.live_workers' rows), read at scrape time."""
        self.workers = workers
        # One client for every scrape (thread-safe: scrapes run on the api's threads): a new
        # one builds an SSL context first, ~25 ms of CPU per scrape for plain-HTTP pages.
        self._http = httpx.Client(timeout=_SCRAPE_TIMEOUT_S)

    def describe(self) -> Iterator[Metric]:
        return iter(())  # the names are the workers': known only when scraped

    def collect(self) -> Iterator[Metric]:
        pages = []
        for worker in self.workers():
            if worker["metrics_port"] is None or worker["host"] is None:
                continue
            url = f"http://{worker['host']}:{worker['metrics_port']}/metrics"
            try:
                pages.append(self._http.get(url).raise_for_status().text)
            except httpx.HTTPError as exc:
                log.warning("worker %s's metrics (%s) left out of this scrape: %s", worker["name"], url, exc)
        yield from aggregate_workers(pages)
