"""What the tests share besides fixtures (conftest.py holds only those): endpoints, builders,
clients, waiting, brokers, Redis targets, the fleet harness and the previous release."""
