"""The small HF config the interop and parity tests build models from; each test states what it changes."""

#: A Llama-like decoder small enough to compare against transformers in milliseconds: grouped
#: queries (8 heads over 2 key/value heads) and a vocabulary that is not a multiple of anything.
HF_SHAPE = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
