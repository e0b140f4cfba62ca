"""Infrastructure shared by the single-file scripts; the algorithms live in the scripts (README: reading order)."""
