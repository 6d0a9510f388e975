"""Training the model over whole sequences (the shipped tiny retrieval model, issue 26)."""
