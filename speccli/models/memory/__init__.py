"""Memory before loading: what a model needs on a GPU, and whether a target splits over
`--tp` ranks."""
