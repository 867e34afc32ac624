"""Autograd graphs: what they keep alive (and, with issue 3's drawing, what each node saved)."""
