"""The calls users make: attention() and prepare(), the backward, varlen, the KV-cache decode, the
torch operators and the drop-in adapters."""
