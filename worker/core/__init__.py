"""The per-message path: what every message passes through, from the consumer's message to its
settled record (the dispatcher, the request, the HTTP client, the attempt records, flow control).

The package build compiles these modules with mypyc where mypy is installed (`setup.py`; the
image, `make compile`), and installs them as Python otherwise: the same sources either way."""
