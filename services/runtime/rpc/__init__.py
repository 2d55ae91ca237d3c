"""The gRPC plumbing every service shares: the server bootstrap with health, reflection, side port,
membership and graceful shutdown (server), the interceptor that sets request ids, checks
authorization and turns domain errors into status codes (interceptors), and servicers whose
bulk requests are read by the service's own reader (method_handlers)."""
