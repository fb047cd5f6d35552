"""The worker process: its wiring (service), the subscriptions it serves (serving), what their
dispatchers share (delivery_setup), and its readiness."""
