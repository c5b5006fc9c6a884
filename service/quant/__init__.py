"""KV quantizers on tensors: uniform QDQ and bit packing, KIVI, KVQuant, dLLM-KVQ, effective-bit accounting."""
