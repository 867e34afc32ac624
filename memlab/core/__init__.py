"""The measurement core: memory sources and tensor accounting (torch only)."""
