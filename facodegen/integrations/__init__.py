"""Backends for other libraries, each imported on its own (none is imported by ``import facodegen``).

``facodegen.integrations.transformers``: ``register()`` makes ``attn_implementation="facodegen"``
work in Hugging Face transformers.
"""
