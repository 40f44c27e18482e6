"""Models: stack discovery, weights and safetensors I/O, LoRA, FSDP2 shards, the chunked LM loss."""
