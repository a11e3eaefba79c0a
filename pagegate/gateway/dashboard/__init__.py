"""The live KV-page dashboard at /dashboard: the pools as a grid, the queues, the health, over SSE (feed.py,
routes.py: the app imports each where it needs it)."""
