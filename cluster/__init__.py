"""pdserve cluster."""
