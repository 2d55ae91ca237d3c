"""The model's tokenizer and chat template, built from GGUF metadata or a HF ``tokenizer.json``.

A GGUF file has no ``tokenizer.json``: it stores the vocabulary, merges, token types and the name
of llama.cpp's pre-tokenizer (``tokenizer.ggml.pre``). We rebuild an equivalent
``tokenizers.Tokenizer`` from those; the pre-tokenizer must split text the way the merges were
learned, or encodings silently drift from the reference.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from services.model_files.chat_template import render_chat_template
from services.model_files.template_budget import TemplateBudget

_IN_PROCESS_BUDGET = TemplateBudget()
"""What a render here may spend: the gateway's default budget."""

# llama.cpp token types (tokenizer.ggml.token_type).
_CONTROL, _USER_DEFINED = 3, 4

_BYTE_LEVEL = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


# tokenizer.ggml.pre -> how text is split before BPE, mirroring llama.cpp's llama-vocab.cpp.
# The "smollm" family isolates every digit first, then applies the GPT-2 regex (as SmolLM2's
# own tokenizer.json does with Digits(individual_digits) + ByteLevel).
_DIGITS_FIRST = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _BYTE_LEVEL])
_PRE_TOKENIZERS: dict[str, pre_tokenizers.PreTokenizer] = {
    **dict.fromkeys(("gpt-2", "mpt", "olmo", "jais"), _BYTE_LEVEL),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"), _DIGITS_FIRST
    ),
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3", "pixtral"),
        _split_then_bytes(_LLAMA3_SPLIT),
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _split_then_bytes(_QWEN2_SPLIT)),
}


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: printable character -> the byte it stands for."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class Tokenizer:
    """Text <-> token ids, chat template rendering, and per-token bytes for streaming detokenization."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: tuple[int, ...],
        chat_template: str | None,
        special_tokens: dict[str, str],
    ):
        self.backend = backend
        """The ``tokenizers.Tokenizer`` doing the work."""
        self.bos_token_id = bos_token_id
        """Beginning-of-sequence id, if any."""
        self.eos_token_ids = eos_token_ids
        """Ids that end generation."""
        self.chat_template = chat_template
        """The model's Jinja chat template, if it ships one."""
        self.special_tokens = special_tokens
        """``bos_token``/``eos_token``/``unk_token``/``pad_token`` text, passed to the chat template."""

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special-token text such as ``<|im_start|>`` maps to its single id.

        ``add_special_tokens`` adds what the model's post-processor adds (e.g. Llama 3's BOS).
        Other Python threads run meanwhile (see :meth:`decode`).
        """
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; an incomplete UTF-8 sequence at the end decodes to U+FFFD.

        Other Python threads run meanwhile: the ``tokenizers`` batch calls let go of the GIL
        while they work, where ``encode``/``decode`` hold it (a megabyte of text held a
        gateway's event loop for a second from another thread)."""
        return self.backend.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)[0]

    def id_to_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for: join them across tokens for UTF-8-safe streaming."""
        return self._token_bytes[token_id]

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        budget: TemplateBudget = _IN_PROCESS_BUDGET,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` (``{"role", "content", ...}`` dicts) as transformers'
        ``apply_chat_template`` does with ``tokenize=False``.

        ``tools`` (OpenAI-shaped ``{"type": "function", "function": {...}}`` definitions) and
        ``documents`` reach the template as transformers passes them; ``chat_template`` replaces
        the model's own (an adapter's); extra ``kwargs`` reach the template as variables.
        Rendered here, within ``budget``'s operations and output (the default budget: the
        gateway renders in processes of their own, :mod:`.template_worker`). Raises
        :class:`~.chat_template.ChatTemplateError` when the template refuses the messages,
        :class:`~.chat_template.TemplateOverBudget` past the budget.
        """
        source = self.chat_template if chat_template is None else chat_template
        if source is None:
            raise ValueError("this model has no chat template")
        variables = self.template_variables(messages, add_generation_prompt, tools=tools, documents=documents)
        return render_chat_template(source, budget, **{**variables, **kwargs})

    def template_variables(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """What a chat template is given (as transformers gives it): the messages, tools,
        documents, whether to open the reply, and this tokenizer's special tokens' text."""
        return {
            **self.special_tokens,
            "messages": messages,
            "tools": tools,
            "documents": documents,
            "add_generation_prompt": add_generation_prompt,
        }

    @functools.cached_property
    def _token_bytes(self) -> list[bytes]:
        spec = json.loads(self.backend.to_str())
        added = {t["id"]: t["content"].encode() for t in spec["added_tokens"]}
        byte_level = "ByteLevel" in json.dumps(spec.get("decoder"))
        alphabet = _byte_decoder()
        table = []
        for token_id in range(self.vocab_size):
            piece = self.backend.id_to_token(token_id)
            if token_id in added or piece is None:
                table.append(added.get(token_id, b""))
            elif byte_level and all(c in alphabet for c in piece):
                table.append(bytes(alphabet[c] for c in piece))
            elif not byte_level and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                table.append(bytes([int(piece[3:5], 16)]))  # sentencepiece byte fallback
            else:
                table.append(piece.replace("\u2581", " ").encode())
        return table

    @classmethod
    def from_gguf(cls, reader) -> Tokenizer:
        """Rebuild the tokenizer a GGUF file describes (``tokenizer.ggml.model`` ``"gpt2"``: byte-level BPE)."""

        def value(key: str, default: Any = None) -> Any:
            field = reader.get_field(key)
            return default if field is None else field.contents()

        kind, pre = value("tokenizer.ggml.model"), value("tokenizer.ggml.pre", "default")
        if kind != "gpt2":
            raise ValueError(
                f"GGUF tokenizer.ggml.model {kind!r} is not supported (supported: 'gpt2' byte-level BPE)"
            )
        if pre not in _PRE_TOKENIZERS:
            raise ValueError(
                f"GGUF tokenizer.ggml.pre {pre!r} is not supported (supported: {sorted(_PRE_TOKENIZERS)})"
            )
        tokens: list[str] = value("tokenizer.ggml.tokens")
        types: list[int] = value("tokenizer.ggml.token_type") or [1] * len(tokens)
        merges = [tuple(m.split(" ", 1)) for m in value("tokenizer.ggml.merges")]
        backend = tokenizers.Tokenizer(
            models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False, byte_fallback=False)
        )
        if pre in ("qwen2", "deepseek-r1-qwen"):
            backend.normalizer = normalizers.NFC()  # as Qwen2's tokenizer.json
        backend.pre_tokenizer = _PRE_TOKENIZERS[pre]
        backend.decoder = decoders.ByteLevel()
        # Control tokens (<|im_start|>...) and user-defined ones must match whole, never through BPE.
        backend.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == _CONTROL]
        )
        backend.add_tokens(
            [
                AddedToken(t, special=False, normalized=False)
                for t, k in zip(tokens, types)
                if k == _USER_DEFINED
            ]
        )

        def token(key: str) -> str | None:
            token_id = value(f"tokenizer.ggml.{key}_token_id")
            return None if token_id is None else tokens[token_id]

        strings = {
            f"{name}_token": text
            for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding"))
            if (text := token(key)) is not None
        }
        # Instruct models end a turn with eot/eom as well as eos (Llama 3's <|eot_id|>).
        eos = [i for k in ("eos", "eot", "eom") if (i := value(f"tokenizer.ggml.{k}_token_id")) is not None]
        _add_post_processor(
            backend,
            strings,
            bos=bool(value("tokenizer.ggml.add_bos_token", False)),
            eos=bool(value("tokenizer.ggml.add_eos_token", False)),
        )
        return cls(
            backend,
            bos_token_id=value("tokenizer.ggml.bos_token_id"),
            eos_token_ids=tuple(dict.fromkeys(eos)),
            chat_template=value("tokenizer.chat_template"),
            special_tokens=strings,
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path, extra_eos_token_ids: tuple[int, ...] = ()) -> Tokenizer:
        """Load ``tokenizer.json`` (+ ``tokenizer_config.json``, ``chat_template.jinja``) from a HF model dir.

        ``extra_eos_token_ids`` adds the ids the model config stops at (Llama 3 instruct lists more
        than its tokenizer's ``eos_token``).
        """
        path = Path(path)
        backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.exists() else {}
        strings = {}
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            token = config.get(name)
            if isinstance(token, dict):
                token = token.get("content")
            if token:
                strings[name] = token
        eos = backend.token_to_id(strings["eos_token"]) if "eos_token" in strings else None
        return cls(
            backend,
            bos_token_id=backend.token_to_id(strings["bos_token"]) if "bos_token" in strings else None,
            eos_token_ids=tuple(
                dict.fromkeys(([eos] if eos is not None else []) + list(extra_eos_token_ids))
            ),
            chat_template=_hf_chat_template(path, config),
            special_tokens=strings,
        )

    def to_json(self) -> str:
        """Everything needed to rebuild this tokenizer without its source file (the converted cache)."""
        return json.dumps(
            {
                "backend": self.backend.to_str(),
                "bos_token_id": self.bos_token_id,
                "eos_token_ids": list(self.eos_token_ids),
                "chat_template": self.chat_template,
                "special_tokens": self.special_tokens,
            }
        )

    @classmethod
    def from_json(cls, text: str) -> Tokenizer:
        """Inverse of :meth:`to_json`."""
        data = json.loads(text)
        return cls(
            tokenizers.Tokenizer.from_str(data["backend"]),
            bos_token_id=data["bos_token_id"],
            eos_token_ids=tuple(data["eos_token_ids"]),
            chat_template=data["chat_template"],
            special_tokens=data["special_tokens"],
        )


def _add_post_processor(
    backend: tokenizers.Tokenizer, strings: dict[str, str], *, bos: bool, eos: bool
) -> None:
    # What encode(add_special_tokens=True) adds, per the file's add_bos_token / add_eos_token flags.
    before = [strings["bos_token"]] if bos and "bos_token" in strings else []
    after = [strings["eos_token"]] if eos and "eos_token" in strings else []
    if not before and not after:
        return
    backend.post_processor = processors.TemplateProcessing(
        single=" ".join([*before, "$A", *after]),
        pair=" ".join([*before, "$A", *after, *before, "$B:1", *after]),
        special_tokens=[(t, backend.token_to_id(t)) for t in dict.fromkeys(before + after)],
    )


def _hf_chat_template(path: Path, config: dict[str, Any]) -> str | None:
    # transformers >= 4.43 saves the template beside the config; older ones inline it, sometimes
    # as a list of named templates of which "default" is the chat one.
    if (path / "chat_template.jinja").exists():
        return (path / "chat_template.jinja").read_text()
    template = config.get("chat_template")
    if isinstance(template, list):
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template
