"""Operator commands: the registry and subscriptions (`admin`), dead letters (`dlq`), `publish`.
Each returns what to print; `render` lays out tables; `explain` turns any error into one line."""
