"""The model on the device mesh: mesh and partition specs, KV cache, RoPE, HF weights, the attention layer
(`attention/`) and the DeepSeek-V3.2 modules (`deepseek_v32.py`)."""
