"""What the engine reports: metrics, stats and health, KV-cache events; each module imported by name (monitor.py
pulls in the page core, which a gateway never needs)."""
