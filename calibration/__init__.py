"""Offline calibration: corpus, TRACE, diagnostics, policy and KVQuant fitting."""
