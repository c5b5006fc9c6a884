"""Persistence: artifact stores (Redis, local directory), the active configuration per cache mode, audit."""
