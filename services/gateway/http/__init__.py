"""The gateway's HTTP API (Starlette on uvicorn), a second front end over the same parts as the
gRPC servicer (:mod:`services.gateway.parts`): one folder per dialect (:mod:`.openai`,
:mod:`.vllm`, :mod:`.lorax`) and, here, what they share: the app (:mod:`.app`), the server, body
parsing, errors, client disconnects, choices and the OpenAPI document."""
