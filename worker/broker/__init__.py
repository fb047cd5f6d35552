"""Pulsar: the consumer adapter, dead-letter publishing, prefetch sizing kept in Redis, the admin API
(backlogs, cursors), topic watches, and the embedded broker."""
