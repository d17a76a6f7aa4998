"""Weight and tokenizer formats: GGUF headers, tensors, configs and tokenizers, and the
cache of converted weights."""
