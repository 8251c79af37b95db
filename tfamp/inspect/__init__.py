"""Showing users what the rewrite did: FLOP shares, decision chains, diffs, files, the HTML page."""
