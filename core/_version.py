"""The package version and the engine protocol version backends declare against."""

__version__ = "0.1.0"

# major.minor: a backend spec must name the same major; minors only add optional parts.
# 1.1: the optional embed (capability embeddings); 1.2: prefill_batch (batched_prefill);
# 1.3: import_prefix_tail (portable_prefix_tail); 1.4: generate_with_prefill (mixed_step)
PROTOCOL_VERSION = "1.4"
