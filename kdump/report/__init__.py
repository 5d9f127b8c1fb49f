"""Bug reports from bundles: what differs between two calls, routing summaries, Markdown."""
