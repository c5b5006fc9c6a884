"""Block-diffusion decoding engine: LLaDA and Dream models, the KV store seam, no-cache / prefix / dual cache."""
