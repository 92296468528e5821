"""Built-in budget schedulers: how large the shortlist may be at each draft depth."""
