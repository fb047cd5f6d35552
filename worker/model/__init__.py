"""What the config file and the registry say: the worker's settings, subscriptions, filters, and the
operator API's settings, each parsed and checked."""
