"""What every service needs to know of the base model's files, read without loading weights: its
identity and dimensions (``base_model``, what the adapter store checks adapter shapes against), its
decoder config (``model_config``), its tokenizer and chat template (``tokenizer``, and
``tokenizer_loading`` for the tokenizer alone, as the gateway loads it), chat templates rendered
under a budget (``chat_template``, ``template_budget``) in processes of their own
(``template_process``, ``template_worker``), where what is derived from
those files is cached (``cache_dir``), and PEFT's LoRA names and rank/alpha pattern rules
(``peft_format``), which the adapter store and the worker must read alike. No torch here and nothing
of any service: the services import this package, never the other way round.
"""
