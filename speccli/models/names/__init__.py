"""Names and where models come from: the registry of aliases, the real models that ship in
PyPI packages, and the shapes of registered models."""
