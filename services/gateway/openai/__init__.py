"""The gateway's OpenAI-compatible HTTP API (Starlette on uvicorn), a second front end over the
same core as the gRPC servicer (:mod:`services.gateway.core`)."""
