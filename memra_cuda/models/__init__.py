"""Models at the edge of the package: they drive round-stream, round-stream knows none of them."""
