"""Model backends: the protocol the decode loop needs, and transformers, static-cache and llama.cpp."""
