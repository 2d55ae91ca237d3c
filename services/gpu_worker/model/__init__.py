"""The base model's weights and decoder: GGUF / HF loaders, the Llama-family model (entry point:
``loading.load_model``). Its config and tokenizer are read by :mod:`services.model_files`."""
