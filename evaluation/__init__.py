"""lm-eval integration and the paper result matrix."""
