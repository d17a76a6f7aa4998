"""Drafters: where candidate tokens come from (draft model, prompt lookup, lookahead, heads, trees)."""
