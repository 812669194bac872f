"""The HTTP edge shared by the engine server and the router: OpenAI-shaped errors, request
limits, graceful drain and the OpenAI protocol models."""
