"""Process plumbing every part may use: asyncio helpers, logs, errors, supervised tasks, input
fields read with clear errors, resource budgets, the status listener. Imports nothing else of the worker."""
