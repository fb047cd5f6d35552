"""push-worker: the push-delivery worker fleet of a Pulsar-based Pub/Sub platform."""

from worker.compiled import check_fresh

__version__ = "0.1.0"

check_fresh()
