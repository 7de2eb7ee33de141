"""Building blocks of the K2 family, one concept per file."""
