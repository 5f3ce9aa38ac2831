"""Feature tables beside the index's core ones, each with its own statements: run health (`health`) and stored
comparisons (`compares`)."""
