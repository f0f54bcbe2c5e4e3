"""SGLang 0.5.23 integration: the ``witcert`` attention backend and KV pool, shipped as an SGLang plugin.

Entry point ``witcert = witcert.integrations.sglang:register`` in the ``sglang.srt.plugins`` group
(docs/SGLANG.md). Importing this package does not import SGLang; ``register`` does.
"""

from witcert.integrations.sglang.plugin import register

__all__ = ["register"]
