"""Redis: the client the fleet keeps its state through (standalone, Cluster, Sentinel), and a local
Redis for the embedded worker."""
