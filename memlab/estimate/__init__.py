"""Predicting GPU memory on a machine without one (issue 7): the caching-allocator model first."""
