"""Helpers shared by tests: free ports, a private redis-server, a uvicorn server process."""
