"""Built-in shortlisters: which vocabulary rows the draft head scores at each draft step."""
