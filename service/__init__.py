"""dllm-kvq: serving diffusion language models with quantized KV-cache reuse."""
