"""Running pagegate on a cluster scheduler. `pagegate.deploy.ray` (extra `pagegate[ray]`): replicas on Ray
Serve with prefix-aware routing. Nothing here is imported by the server itself."""
