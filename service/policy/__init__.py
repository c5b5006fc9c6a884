"""Policy tables, KVQuant states and their stores (Redis, local directory)."""
