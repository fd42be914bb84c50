"""Golden histories: recorded commands in, expected decisions out (see record.py)."""
