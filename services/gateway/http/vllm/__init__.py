"""What vLLM's OpenAI server adds to OpenAI's API: adapter loading, ``/tokenize`` and
``/detokenize``, and its server routes (``/health``, ``/version``, ``/metrics``...)."""
