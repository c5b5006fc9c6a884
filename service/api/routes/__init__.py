"""HTTP routes: thin functions that parse, call one method of a long-lived object, and shape the answer."""
