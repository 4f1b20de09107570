"""The HTTP surfaces: REST and ingress, MCP, and the streams they share."""
