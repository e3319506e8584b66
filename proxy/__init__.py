"""prefixgate: the prompt-caching reverse proxy."""
