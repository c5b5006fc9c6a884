"""Fitted artifacts (policy tables, KVQuant states): schemas, content ids, checks against a model."""
