"""vLLM's ``POST /tokenize`` and ``POST /detokenize``, with the gateway's tokenizer: the base
model's, which every adapter shares.

``/tokenize`` takes ``{"model", "prompt", "add_special_tokens"}`` (default true), or
``{"model", "messages", "add_generation_prompt", "add_special_tokens"}`` (defaults true and false:
the chat template writes its special tokens itself), and answers ``{"count", "max_model_len",
"tokens", "token_strs"}`` (``token_strs`` null). ``/detokenize`` takes ``{"model", "tokens"}``
and answers ``{"prompt"}``; an id outside the vocabulary is a 400 naming ``tokens``. ``model`` is
the base model or an adapter the key may use (absent: the base model), as on the generation
routes, which is also why these need an API key where vLLM's do not.
"""

from __future__ import annotations

import asyncio

from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from services.gateway.http.errors import OpenAIError
from services.gateway.http.model_names import requested_adapter
from services.gateway.http.openai.requests import ChatMessageBody, chat_messages
from services.gateway.http.reading import parse_body, read_body, tenant
from services.gateway.parts import GatewayParts
from services.runtime.sampling.request_validation import check_token_ids


class _ModelBody(BaseModel):
    model_config = ConfigDict(extra="ignore")  # as vLLM, which also has fields loramesh does not

    model: str | None = None


class TokenizeBody(_ModelBody):
    prompt: str | None = None
    messages: list[ChatMessageBody] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None
    """None: vLLM's default, true for a prompt and false for messages."""
    continue_final_message: bool = False
    return_token_strs: bool = False
    chat_template: str | None = None

    def check(self) -> None:
        refused = (
            ("continue_final_message", self.continue_final_message, "the final message is not continued"),
            ("return_token_strs", self.return_token_strs, "no token strings"),
            ("chat_template", self.chat_template is not None, "the model's own template is used"),
        )
        for field, is_set, why in refused:
            if is_set:
                raise OpenAIError(
                    400, f"{field} is not supported by loramesh ({why})", field, "unsupported_parameter"
                )
        if (self.prompt is None) == (self.messages is None):
            raise OpenAIError(
                400, "give either prompt or messages", "prompt" if self.prompt is None else "messages"
            )


class DetokenizeBody(_ModelBody):
    tokens: list[int]


class TokenizeRoutes:
    """Handlers bound to one gateway's parts."""

    def __init__(self, parts: GatewayParts):
        self.parts, self.core = parts, parts.core

    async def tokenize(self, request: Request) -> Response:
        caller = tenant(self.core, request)
        body = parse_body(await read_body(request.stream()), TokenizeBody)
        body.check()
        # 404 unless the key may use it
        adapter = await requested_adapter(self.parts, caller, body.model or "")
        if body.messages is not None:
            tokens = await self.core.chat_prompt(
                caller,
                chat_messages(body.messages),
                body.add_generation_prompt,
                bool(body.add_special_tokens),
                adapter=adapter,
            )
        else:
            add_special_tokens = True if body.add_special_tokens is None else body.add_special_tokens
            tokens = await self.core.tokenize(body.prompt or "", add_special_tokens)
        return JSONResponse(
            {
                "count": len(tokens),
                "max_model_len": self.core.context_length,
                "tokens": tokens,
                "token_strs": None,
            }
        )

    async def detokenize(self, request: Request) -> Response:
        caller = tenant(self.core, request)
        body = parse_body(await read_body(request.stream()), DetokenizeBody)
        await requested_adapter(self.parts, caller, body.model or "")
        check_token_ids("tokens", "tokens", body.tokens, self.core.tokenizer.vocab_size)
        # decode lets go of the GIL: the event loop runs on while a long list decodes
        return JSONResponse({"prompt": await asyncio.to_thread(self.core.tokenizer.decode, body.tokens)})

    def routes(self) -> list[Route]:
        return [
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
        ]
