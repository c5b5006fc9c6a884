"""FastAPI routes, schemas, dependencies and error mapping."""
