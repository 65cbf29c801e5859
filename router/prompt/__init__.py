"""A request's prompt as vLLM sees it: rendered (chat), tokenized and hashed into block keys.

The modules here make the router's token ids and block keys identical to the engine's:
``prompt_fields`` reads the request, ``chat_render``/``chat_template`` render chat, ``tokenize``
is a model's tokenizer, ``segments`` tokenizes only the unseen parts, ``prompt_ids`` runs it
on or off the event loop, ``remote_tokenize`` asks a backend, and ``history``, ``hash_cache``
and ``cold`` route before the whole prompt is tokenized.
"""
