"""push-worker: the push-delivery worker fleet of a Pulsar-based Pub/Sub platform."""

__version__ = "0.1.0"
