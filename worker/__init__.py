"""push-worker: the push-delivery worker fleet of a Pulsar-based Pub/Sub platform.

Its version is the installed distribution's (`push-worker --version`, importlib.metadata), never a
constant here: one here said 0.1.0 for every release.
"""
